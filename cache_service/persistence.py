"""The service's storage side: what it writes to Redis and reads back, as data.

Commits are written at once, or, while Redis cannot take them, journaled on local disk and
replayed by :meth:`RedisPersistence.flush` when it returns (:mod:`cache_service.commits`).
Reading the lifetime log keeps one cursor per namespace and skips this process's own entries.
Nothing here holds or changes the service: each call returns what it read or wrote, and the
caller (the service, or :mod:`cache_service.sync` for the background jobs) applies it.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cache_service.commits import CommitWriter
from cache_service.domain.changes import Saved, SessionChange, SessionDelta
from cache_service.domain.errors import Unavailable
from cache_service.domain.ports import Committed, Logged, PriorPage, Requests
from cache_service.host import prior_files
from cache_service.host.journal import Journal, JournalRecord
from cache_service.storage.errors import StorageError, StorageUnavailable
from cache_service.storage.redis_store import RedisStore
from cache_service.storage.sessions import SessionAppend, SessionWrite
from cache_service.storage.stored_session import StoredSession
from cache_service.storage.stream_log import LogEntry, position, stream_id
from indexer.lifetime_index import LogId
from indexer.prior import StaticPrior

logger = logging.getLogger(__name__)

SAVE_BATCH = 256  # sessions written per pipelined round trip
LOG_PAGE = 32  # log entries read per round trip for a decoder's near copy


class SessionsNotSaved(StorageUnavailable):
    """A write-back storage failed part-way through: ``unsaved``, the sessions whose change it
    may not hold (the batch that failed and those after it), and ``undeleted``, the closed
    sessions it did not delete (they expire)."""

    def __init__(self, cause: StorageError, unsaved: list[str], undeleted: int) -> None:
        super().__init__(str(cause))
        self.unsaved = unsaved
        self.undeleted = undeleted


class RedisPersistence:
    """The service's :class:`~cache_service.domain.ports.Persistence` on a :class:`RedisStore`;
    ``prior_dir``: priors are saved there once and memory-mapped (shared by processes);
    ``journal``: commits storage cannot take are kept there (:mod:`cache_service.commits`)."""

    def __init__(
        self,
        store: RedisStore,
        *,
        max_pending: int,
        prior_dir: Path | None = None,
        journal: Journal | None = None,
        calls: RedisStore | None = None,
        replicas: int = 0,
        wait_ms: int = 1000,
    ) -> None:
        self.store = store
        # What a call waits on (a commit's append, a stored session, the log and prior pages a
        # decoder reads): a client with short timeouts, so a hung Redis holds a call briefly and
        # a commit is journaled instead. ``store`` (long timeouts) serves the background jobs.
        self.calls = calls or store
        self.commits = CommitWriter(
            store,
            max_pending=max_pending,
            journal=journal,
            on_written=self._remember,
            on_journaled=self._hold,
            direct=self.calls,
            replicas=replicas,
            wait_ms=wait_ms,
        )
        self._prior_dir = prior_dir
        self._own: dict[str, set[str]] = {}  # per namespace: ids of entries this process appended
        # Per namespace: keys of commits this process journaled (its memory has them) -> when. An
        # entry under such a key is skipped when following, whoever appended it: a client that
        # retried the commit on another replica made that one append it too (see _hold).
        self._held: dict[str, dict[str, float]] = {}
        self._last: dict[str, str] = {}  # per namespace: the last log entry read
        self._lock = threading.Lock()
        # Held briefly, never across a storage call, by whoever reads or moves the cursors: a
        # caller that forgets a namespace (DeleteNamespace) takes it too, and must not wait out
        # a hung storage's background timeout behind a follow.
        self._sync_lock = threading.Lock()
        self._forgets = 0  # namespaces forgotten so far: a follow read across one is not applied
        self._successors_seen: dict[str, str] = {}  # per namespace: the last successor change read

    @property
    def pending(self) -> int:
        return self.commits.pending

    def oldest_pending_age_s(self) -> float:
        """How long the oldest unwritten commit has waited (0 when none is waiting)."""
        return self.commits.oldest_pending_age_s()

    # -- commits -------------------------------------------------------------------------------

    @property
    def prior_dir(self) -> Path | None:
        """Where priors are saved and mapped (``None``: held in memory only)."""
        return self._prior_dir

    def namespace_created(self, name: str, vocab_size: int) -> None:
        self.commits.forget(name)  # a new namespace's log, whatever was known of an old one's
        try:  # a caller waits: within the call timeout
            self.calls.register_namespace(name, vocab_size)
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc

    def tokenizer_claimed(self, name: str, fingerprint: str) -> str:
        try:  # a caller waits: within the call timeout
            return self.calls.claim_tokenizer(name, fingerprint)
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc

    def namespace_deleted(self, name: str) -> bool:
        self.namespace_forgotten(name)
        try:  # a caller waits: each command within the call timeout (a retry finishes the deletion)
            return self.calls.delete_namespace(name).registered
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc

    def namespace_forgotten(self, name: str) -> None:
        """A namespace deleted: what was kept of its log goes (names come and go for weeks)."""
        self.commits.forget(name)
        with self._sync_lock, self._lock:
            self._forgets += 1
            self._last.pop(name, None)
            self._successors_seen.pop(name, None)
            self._own.pop(name, None)
            self._held.pop(name, None)

    def requests_committed(self, namespace: str, requests: list[np.ndarray], keys: Sequence[str] = ()) -> Committed:
        """Write commits (each with its client's key, "" or none: no key) now, or journal them
        while storage cannot take them, so they are durable when the caller is answered
        (:class:`Unavailable` when neither can). Returns what was written, and which of them
        the log held already."""
        return self.commits.commit(namespace, requests, keys)

    def flush(self) -> list[Logged]:
        """Write queued (journaled) commits in order; what was written. ``StorageError`` when
        storage fails (what is still queued stays queued)."""
        return self.commits.flush()

    def _remember(self, logged: Logged) -> None:
        """This process's entries, which following the log skips (called before any other
        thread may read them: the commit writer holds the log while it writes)."""
        with self._lock:
            self._own.setdefault(logged[0], set()).update(stream_id(i) for i in logged[2])

    def _hold(self, records: list[JournalRecord]) -> None:
        """Commits journaled by this process, in its memory already: a request its client sent
        again to another replica (the answer lost) is appended by that one, and this one's replay
        then finds it logged and appends nothing. Following the log, the other's entry would
        enter this memory a second time; held by its key, it is skipped instead. Keys are
        forgotten when an entry under them passes (this process's own included) or, never
        seen (trimmed unread), after the commit-key window."""
        now = time.monotonic()
        with self._lock:
            for r in records:
                if r.key:
                    self._held.setdefault(r.namespace, {})[r.key] = now

    # -- the log, for decoders' near copies ----------------------------------------------------

    def log_after(self, ns: str, after: str, max_tokens: int) -> tuple[list[tuple[str, np.ndarray]], str]:
        """Entries of the log of ``ns`` after the entry ``after`` (every process's), oldest
        first, of at most ``max_tokens`` tokens in all (but at least one where there is one), and
        the id the next read goes on after; ``after`` empty: none, and the id of the log's end."""
        try:
            if not after:
                return [], self.calls.last_log_id(ns)
            out: list[tuple[str, np.ndarray]] = []
            last, total = after, 0
            while True:
                entries = self.calls.read_log(ns, after_id=last, count=LOG_PAGE)
                for entry in entries:
                    if out and total + entry.tokens.size > max_tokens:
                        return out, last
                    out.append((entry.id, entry.tokens))
                    total, last = total + entry.tokens.size, entry.id
                if len(entries) < LOG_PAGE or total >= max_tokens:
                    return out, last
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc

    def prior_page(self, ns: str, version: int, offset: int, max_bytes: int) -> PriorPage | None:
        """See :meth:`~cache_service.domain.ports.Persistence.prior_page`."""
        try:
            if version == 0:
                current = self.calls.prior_version(ns)
                if current is None:
                    return None
                version = current
            found = self.calls.get_prior_range(ns, version, offset, max_bytes)
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc
        if found is None:
            return None
        meta, data = found
        return PriorPage(version=version, size=meta.size, digest=meta.digest, data=data)

    # -- successor rows ------------------------------------------------------------------------

    def save_successors(self, ns: str, tokens: np.ndarray, packed: list[bytes]) -> None:
        """This replica's changed successor rows, written for every replica. ``StorageError``
        when storage fails."""
        self.store.save_successors(ns, self.commits.writer.hex(), tokens, packed)

    def read_successors(self, ns: str) -> tuple[np.ndarray, list[bytes]]:
        """Every stored successor row; later reads of changes start after it."""
        tokens, packed, last = self.store.read_successors(ns)
        with self._sync_lock:
            self._successors_seen[ns] = last
        return tokens, packed

    def successor_changes(self, ns: str) -> tuple[np.ndarray, list[bytes]]:
        """Rows other replicas changed since the last read (all of them on a first read)."""
        with self._sync_lock:
            after = self._successors_seen.get(ns)
        if after is None:
            return self.read_successors(ns)
        tokens, packed, last = self.store.successor_changes(ns, after, self.commits.writer.hex())
        with self._sync_lock:
            self._successors_seen[ns] = last
        return tokens, packed

    # -- sessions ------------------------------------------------------------------------------

    def load_session(self, sid: str) -> StoredSession | None:
        try:
            return self.calls.load_session(sid)
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc

    def sessions_ended(self, sids: list[str]) -> None:
        """Delete the stored copies of sessions closed here, now (each batch within the call
        timeout): until then another replica named one of them would continue it. Skipped
        while storage is known down (a failure here says so, as a commit's does, so later
        closes do not wait on it either): the closed ids stay with the write-back, which
        deletes them (and any copy a write under way when they closed put back)."""
        if not sids or not self.commits.status.available:
            return
        try:
            for start in range(0, len(sids), SAVE_BATCH):
                self.calls.delete_sessions(sids[start : start + SAVE_BATCH])
        except StorageError as exc:
            self.commits.note_failure(exc)

    def save_sessions(self, changed: list[tuple[str, SessionChange]], closed: list[str], ttl_s: float) -> Saved:
        """Write session changes and drop closed sessions. A whole session is one transaction
        (state and rejected table), written unless storage holds another tenant's session
        under its id; a :class:`SessionDelta` appends its tokens (and replaces the rejected
        table when given) only where storage holds exactly the context it extends (where it
        did not, the session expired or was lost meanwhile: write it whole)."""
        writes: list[SessionWrite] = []
        appends: list[SessionAppend] = []
        for sid, change in changed:
            if isinstance(change, SessionDelta):
                appends.append((sid, change.held, change.tokens, change.rejected))
            else:
                writes.append((sid, change))
        written: list[str] = []
        refused: list[str] = []
        missed: list[str] = []
        done = deleted = 0  # changes and closes storage has answered for
        try:
            for start in range(0, len(writes), SAVE_BATCH):  # pipelined, a bounded batch per round trip
                whole = writes[start : start + SAVE_BATCH]
                for (sid, _), ok in zip(whole, self.store.save_sessions(whole, ttl_s), strict=True):
                    (written if ok else refused).append(sid)
                done += len(whole)
            for start in range(0, len(appends), SAVE_BATCH):
                batch = appends[start : start + SAVE_BATCH]
                applied = self.store.append_sessions(batch, ttl_s)
                missed.extend(sid for (sid, *_), ok in zip(batch, applied, strict=True) if not ok)
                done += len(batch)
            for start in range(0, len(closed), SAVE_BATCH):
                self.store.delete_sessions(closed[start : start + SAVE_BATCH])
                deleted = min(len(closed), start + SAVE_BATCH)
        except StorageError as exc:
            order = [sid for sid, _ in writes] + [sid for sid, *_ in appends]
            raise SessionsNotSaved(exc, order[done:], len(closed) - deleted) from exc
        if refused:
            logger.warning("%d sessions not saved: their ids hold another tenant's sessions", len(refused))
        return Saved(missed, written, refused)

    # -- namespaces and the lifetime log -------------------------------------------------------

    def namespaces(self) -> dict[str, int]:
        """Every registered namespace (by another replica or ``draftcache warm`` too) and its
        vocabulary size."""
        return self.store.namespaces()

    def tokenizers(self, names: list[str]) -> dict[str, str]:
        """Each namespace's recorded tokenizer fingerprint ("": none recorded)."""
        return self.store.tokenizers(names)

    def log_identities(self, names: list[str]) -> dict[str, str | None]:
        """Each namespace's log identity (``None``: none made yet); a namespace deleted and
        created again has another, whatever its vocabulary."""
        return self.store.log_identities(names)

    def read_log(self, ns: str, after: LogId | None = None) -> Requests:
        """The whole log of ``ns`` (past ``after``), from which the cursor then follows it."""
        out = Requests([], [], [])
        last = "0" if after is None else stream_id(after)
        while True:
            entries = self.store.read_log(ns, after_id=last)
            if not entries:
                break
            out.tokens.extend(np.array(e.tokens, dtype=np.int32) for e in entries)
            out.ids.extend(position(e.id) for e in entries)
            out.keys.extend(e.key for e in entries if e.key)
            last = entries[-1].id
        with self._sync_lock:
            self._last[ns] = last
        return out

    def follow(self, ns: str, covered: LogId | None = None) -> Requests:
        """Requests other processes appended to the log of ``ns`` since the last read, except
        those up to ``covered`` (an adopted generation indexes them already) and those under a
        key this process journaled (see :meth:`_hold`). The read is taken only where the cursor
        did not move while storage answered (a generation adopted, a namespace forgotten):
        else nothing is, and the next follow reads from where the cursor is then."""
        with self.commits.writing:
            with self._sync_lock:
                after, forgets = self._last.get(ns, "0"), self._forgets
            entries = self.store.read_log(ns, after_id=after)
            return self._followed(ns, after, forgets, entries, covered)

    def _followed(self, ns: str, after: str, forgets: int, entries: list[LogEntry], covered: LogId | None) -> Requests:
        """What :meth:`follow` read after ``after``, taken (see there)."""
        out = Requests([], [], [])
        with self._sync_lock:
            if not entries or self._last.get(ns, "0") != after or self._forgets != forgets:
                return out
            own = self._own.get(ns, set())
            known = self._passed_keys(ns, [e.key for e in entries if e.key])  # journaled here: in memory
            for entry in entries:
                if entry.id in own:
                    own.discard(entry.id)
                    continue
                if entry.key not in known and (covered is None or position(entry.id) > covered):
                    out.tokens.append(np.array(entry.tokens, dtype=np.int32))
                    out.ids.append(position(entry.id))
                if entry.key:
                    out.keys.append(entry.key)
            self._last[ns] = entries[-1].id
            self._drop_own(ns, position(entries[-1].id))  # any left up to there were trimmed unread
            return out

    def _passed_keys(self, ns: str, keys: list[str]) -> set[str]:
        """Of ``keys`` (the entries following passes), those held for ``ns`` (see :meth:`_hold`);
        all of them are held no longer, nor any past the commit-key window."""
        oldest = time.monotonic() - self.store.config.commit_key_ttl_s
        with self._lock:
            held = self._held.get(ns)
            if not held:
                return set()
            for key in [k for k, since in held.items() if since < oldest]:
                del held[key]
            return {k for k in keys if held.pop(k, None) is not None}

    def _drop_own(self, ns: str, through: LogId) -> None:
        """Forget this process's entries of ``ns`` up to ``through``: following goes on past them."""
        with self._lock:
            own = self._own.get(ns)
            if own:
                own.difference_update([i for i in own if position(i) <= through])

    def skip_to(self, ns: str, through: LogId) -> None:
        """The log of ``ns`` up to ``through`` is indexed already (an adopted generation): it
        need not be read again, nor this process's entries in it remembered."""
        with self._sync_lock:
            if position(self._last.get(ns, "0")) < through:
                self._last[ns] = stream_id(through)
                self._drop_own(ns, through)

    # -- priors --------------------------------------------------------------------------------

    def prior_version(self, ns: str) -> int | None:
        """The version of the prior replicas should serve (``None``: none published)."""
        return self.store.prior_version(ns)

    def load_prior(self, ns: str) -> tuple[StaticPrior, int] | None:
        """The published prior of ``ns`` and its version; with a prior folder, saved there once
        and memory-mapped (so processes of a host share one copy). A saved folder that does not
        load (damaged) is saved again from storage."""
        if self._prior_dir is not None:
            version = self.store.prior_version(ns)
            if version is not None:
                mapped = self._mapped(ns, version)
                if mapped is not None:
                    return mapped, version
        found = self.store.get_prior(ns)
        if found is None:
            return None
        version, blob = found
        prior = StaticPrior.from_bytes(bytes(blob))
        if self._prior_dir is None:
            return prior, version
        prior_files.save(prior, prior_files.folder_for(self._prior_dir, ns, version))
        del prior, blob
        mapped = self._mapped(ns, version)
        if mapped is None:  # another process's copy, damaged (now removed), or removed meanwhile
            raise ValueError(f"namespace {ns!r}: prior version {version} saved but not loaded")
        return mapped, version

    def _mapped(self, ns: str, version: int) -> StaticPrior | None:
        """The version saved on this host, mapped, and the versions before the previous one
        removed; ``None`` when it is not saved here, or not whole (it is then removed)."""
        folder = prior_files.folder_for(self._prior_dir or Path(), ns, version)
        if not folder.exists():
            return None
        try:
            prior = prior_files.load(folder)
        except ValueError as exc:
            logger.warning("namespace %s: damaged prior folder removed, to be saved again: %s", ns, exc)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        prior_files.prune(folder.parent, version)
        logger.info("namespace %s: static prior version %d mapped from %s", ns, version, self._prior_dir)
        return prior

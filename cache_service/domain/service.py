"""The service's domain layer: namespaces, sessions, batched open/draft/feedback/close.

Every batch is checked whole (:mod:`~cache_service.domain.admission` for the limits,
:mod:`~cache_service.domain.tokens` and :mod:`~cache_service.domain.names` for what the client
sent) before any state changes, so a bad item never leaves half a batch applied. Durable side
effects (lifetime log, namespace registry) go through a
:class:`~cache_service.domain.ports.Persistence`; session changes are handed over by
:meth:`DraftService.take_changes` (see :mod:`~cache_service.domain.changes`). Without
persistence the service keeps everything in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from cache_service.config import ServiceConfig
from cache_service.domain import drafting, names, tokens
from cache_service.domain.admission import Admission
from cache_service.domain.busy import BusyShare
from cache_service.domain.changes import Changes, ChangeTracker, Saved
from cache_service.domain.continuing import Continuing, Found
from cache_service.domain.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    unknown_session,
)
from cache_service.domain.items import (
    CloseItem,
    DraftColumns,
    Drafted,
    DraftItem,
    FeedbackItem,
    NamespaceStats,
    Opening,
    OpenItem,
)
from cache_service.domain.namespaces import Namespaces, check_vocab_size
from cache_service.domain.opening import Opener
from cache_service.domain.ports import Committed, Logged, Persistence, PriorPage, Requests
from cache_service.domain.repeats import RecentKeys
from cache_service.domain.sessions import SessionEntry, SessionTable
from cache_service.domain.tenants import Principal, owns
from cache_service.storage.stored_session import StoredSession
from cache_service.storage.stream_log import check_stream_id
from indexer.drafter import NamespaceDrafter
from indexer.prior import StaticPrior
from indexer.session import Session
from indexer.tree_builder import DraftTree

MAX_LOG_READ_TOKENS = 1 << 18  # tokens one log read returns at most (about 0.8 MB on the wire)
MAX_PRIOR_PAGE_BYTES = 3 << 20  # bytes of a prior one read returns at most (under gRPC's 4 MB message)
# Idle sessions dropped by one write-back round at most (rounds come every flush interval):
# expiry then holds the serving loop briefly, yet keeps up with any realistic turnover.
EXPIRE_BATCH = 1024

__all__ = ["CloseItem", "DraftColumns", "DraftItem", "DraftService", "Drafted", "FeedbackItem", "OpenItem"]

Refresh = Callable[[list[str]], None]  # reload priors and rebuild the named namespaces' indexes now


class DraftService:
    """Batched drafting over many namespaces and sessions.

    ``shared_lifetime``: lifetime indexes are built once per host and adopted (see
    :mod:`cache_service.sync`), not built here. :attr:`refresh`, when set (by the entry point,
    which owns storage), serves the admin :meth:`rebuild`.
    """

    def __init__(
        self, config: ServiceConfig, persistence: Persistence | None = None, *, shared_lifetime: bool = False
    ) -> None:
        if shared_lifetime and persistence is None:
            raise ValueError("shared lifetime indexes come through persistence")
        self.config = config
        self._persistence = persistence
        self.shared_lifetime = shared_lifetime
        self.namespaces = Namespaces(config.drafter, own_ring=not shared_lifetime)
        self.sessions = SessionTable(max_sessions=config.max_sessions, ttl_s=config.session_ttl_s)
        self.changes = ChangeTracker(self.sessions, config.table_flush_interval_s, max_closed=config.max_sessions)
        # Without storage any session may leave memory (its client re-opens it); with it, only
        # one whose changes storage holds (a later call continues it from there).
        saved = persistence is not None
        self.admission = Admission(config, self.sessions, lambda sid: not saved or not self.changes.pending(sid))
        self._continuing = Continuing(
            self._load, self.namespaces, self.sessions, self.admission.make_room, self.changes.ended_lately
        )
        self._opener = Opener(config.default_params, self.namespaces, self.sessions, self.admission, self.changes)
        self.refresh: Refresh | None = None
        self._orphaned = False  # a namespace deleted elsewhere may have left live sessions
        self._drafts = 0  # served trees (updated on the serving thread only)
        self._busy = BusyShare()  # how much of the last second draft calls took
        self._ahead_skipped = 0  # items whose drafting ahead was skipped, the service busy
        self._recent = RecentKeys()  # commit keys the lifetime memory took lately

    # -- namespaces --------------------------------------------------------------------------

    def create_namespace(
        self,
        name: str,
        vocab_size: int,
        *,
        persist: bool = True,
        principal: Principal | None = None,
        tokenizer: str = "",
    ) -> NamespaceDrafter:
        """The namespace's drafter, registered in storage when new (``persist``); one restored
        from storage (not ``persist``) keeps the vocabulary it was registered with. ``tokenizer``
        (a fingerprint, "": not stated) is registered with it unless another one is, which is
        :class:`AlreadyExists` (the namespace stays as it was)."""
        names.namespace_name(name)
        if persist:
            check_vocab_size(vocab_size)
        names.tokenizer(tokenizer)
        if principal is not None:
            principal.check_namespace(name)
        drafter = self._create_namespace(name, vocab_size, persist=persist)
        if tokenizer:
            self._claim_tokenizer(name, drafter, tokenizer, persist=persist)
        return drafter

    def _claim_tokenizer(self, name: str, drafter: NamespaceDrafter, tokenizer: str, *, persist: bool) -> None:
        """Register ``tokenizer`` with the namespace unless another one is (in storage, the
        first claim wins); :class:`AlreadyExists` when another one is."""
        if persist and self._persistence is not None:
            registered = self._persistence.tokenizer_claimed(name, tokenizer)
        else:
            registered = self.namespaces.tokenizer(name) or tokenizer
        self.namespaces.set_tokenizer(name, drafter, registered)
        if registered != tokenizer:
            raise AlreadyExists(f"namespace {name!r} holds the ids of tokenizer {registered}, not {tokenizer}")

    def _create_namespace(self, name: str, vocab_size: int, *, persist: bool) -> NamespaceDrafter:
        drafter, created = self.namespaces.create(name, vocab_size)
        if persist and self._persistence is not None:  # again when it exists: a retry after a failure
            try:
                self._persistence.namespace_created(name, vocab_size)
            except BaseException:
                if created:  # not registered: not served either
                    with self.namespaces.unchanged():
                        if self.namespaces.current(name, drafter) and self.namespaces.remove(name):
                            self._orphaned = True
                raise
        return drafter

    def namespace(self, name: str) -> NamespaceDrafter:
        return self.namespaces.get(name)

    def delete_namespace(self, name: str, *, principal: Principal | None = None) -> int:
        """:meth:`unregister_namespace`, then :meth:`drop_namespace`: the namespace gone from
        storage and from this replica (other replicas drop it when their sync notices); how
        many live sessions ended."""
        return self.drop_namespace(name, registered=self.unregister_namespace(name, principal=principal))

    def unregister_namespace(self, name: str, *, principal: Principal | None = None) -> bool:
        """The first part of :meth:`delete_namespace` (any thread: it waits on storage): the name
        and the caller checked, then everything storage keeps of the namespace removed (its
        registration first, so no replica discovers it again); whether it was registered."""
        names.namespace_name(name)
        if principal is not None:
            principal.check_namespace(name)
        return self._persistence is not None and self._persistence.namespace_deleted(name)

    def drop_namespace(self, name: str, *, registered: bool = False) -> int:
        """The last part of :meth:`delete_namespace` (on the serving thread): the namespace's
        live sessions end without commit (storage drops their copies) and its drafter goes;
        how many sessions ended. :class:`NotFound` when neither this replica nor storage
        (``registered``) knew it."""
        if not self.namespaces.remove(name) and not registered:
            raise NotFound(f"unknown namespace {name!r}")
        return self._end_orphans(name)

    def forget_namespace(self, name: str) -> None:
        """A namespace deleted elsewhere (any thread: storage sync calls it): its drafter goes
        now, its live sessions at the next :meth:`take_changes` (on the serving thread)."""
        if self.namespaces.remove(name):
            self._orphaned = True
        if self._persistence is not None:
            self._persistence.namespace_forgotten(name)

    def _end_orphans(self, name: str = "") -> int:
        """End the sessions whose namespace was removed; how many were of ``name``."""
        self._orphaned = False
        ended = self.sessions.entries_where(lambda e: not self.namespaces.current(e.namespace, e.drafter))
        for entry in ended:
            self.sessions.discard(entry.sid)
            self.changes.closed(entry)
        return sum(entry.namespace == name for entry in ended)

    def namespace_names(self) -> list[str]:
        return self.namespaces.names()

    def set_prior(self, name: str, prior: StaticPrior | None, version: int) -> None:
        """Swap a namespace's static prior (one reference assignment: drafts never wait)."""
        self.namespaces.set_prior(name, prior, version)

    def prior_version(self, name: str) -> int:
        return self.namespaces.prior_version(name)

    def mark_logged(self, logged: Iterable[Logged]) -> None:
        """Where this process's commits fall in the lifetime log (shared indexes only: an adopted
        generation then replaces them)."""
        if self.shared_lifetime:
            self.namespaces.mark_logged(logged)

    def stats(self, name: str = "", *, principal: Principal | None = None) -> list[NamespaceStats]:
        """Per namespace; a caller limited to some namespaces sees only those."""
        if name:
            names.namespace_name(name)
            if principal is not None:
                principal.check_namespace(name)
        names_ = [name] if name else [n for n in self.namespace_names() if principal is None or principal.may_use(n)]
        sessions = self.sessions.count_by_namespace()
        return [self.namespaces.stats(n, sessions.get(n, 0)) for n in names_]

    @property
    def drafts(self) -> int:
        return self._drafts

    @property
    def ahead_skipped(self) -> int:
        """Draft items that asked for outcomes drafted ahead and got none: drafting kept the
        process busier than ``ServiceConfig.ahead_busy_limit``."""
        return self._ahead_skipped

    @property
    def pending_writes(self) -> int:
        return 0 if self._persistence is None else self._persistence.pending

    def rebuild(self, name: str = "", *, principal: Principal | None = None) -> list[NamespaceStats]:
        """Reload published priors and rebuild lifetime indexes now (the scheduler does this on
        its own, off the request path)."""
        if name:
            names.namespace_name(name)
        if principal is not None and principal.namespaces is not None:
            if not name:
                raise PermissionDenied(f"tenant {principal.tenant!r} may rebuild only its own namespaces, by name")
            principal.check_namespace(name)
        chosen = [name] if name else self.namespace_names()
        if name:
            self.namespace(name)  # an unknown one is NOT_FOUND
        if self.refresh is not None:
            self.refresh(chosen)
        else:
            for n in chosen:
                self.namespace(n).memory.rebuild()
        return self.stats(name, principal=principal)

    # -- the log, for decoders' near copies ---------------------------------------------------

    def read_log(
        self,
        name: str,
        after: str,
        max_tokens: int,
        *,
        principal: Principal | None = None,
        vocab_size: int = 0,
        tokenizer: str = "",
    ) -> tuple[list[tuple[str, np.ndarray]], str]:
        """The lifetime log of ``name`` after the entry ``after`` (empty: from its end now), in
        entries of at most ``max_tokens`` tokens in all (at least one); and where to go on from.
        Checked before storage is asked: the name, the caller's right to it, its model's
        vocabulary (``vocab_size``, 0: not stated) and tokenizer (a fingerprint, "": not
        stated), the range, the id."""
        self._check_readable(name, principal, vocab_size, tokenizer)
        if not 1 <= max_tokens <= MAX_LOG_READ_TOKENS:
            raise InvalidArgument(f"max_tokens must be in [1, {MAX_LOG_READ_TOKENS}], got {max_tokens}")
        if after:
            try:
                check_stream_id(after)
            except ValueError as exc:
                raise InvalidArgument(f"after must be a log entry id or empty: {exc}") from exc
        if self._persistence is None:
            raise FailedPrecondition("this service keeps no lifetime log: it runs without storage")
        return self._persistence.log_after(name, after, max_tokens)

    def _check_readable(self, name: str, principal: Principal | None, vocab_size: int, tokenizer: str) -> None:
        """A namespace a near copy may read: a valid name, the caller's right to it, one this
        service has (else NOT_FOUND), of the caller's vocabulary and tokenizer where it states
        them (else FAILED_PRECONDITION)."""
        names.namespace_name(name)
        names.tokenizer(tokenizer)
        if principal is not None:
            principal.check_namespace(name)
        self.namespaces.get(name, vocab_size, tokenizer)

    def read_prior(
        self,
        name: str,
        version: int,
        offset: int,
        max_bytes: int,
        *,
        principal: Principal | None = None,
        vocab_size: int = 0,
        tokenizer: str = "",
    ) -> PriorPage:
        """A page of the stored blob of ``name``'s static prior ``version`` (0: the current one),
        for a near copy to draft with the prior the service drafts with. Version 0 in the
        answer: the namespace has no prior. A version gone (two publishes since) is NOT_FOUND:
        the reader starts again from the current one. Checked before storage is asked (as
        :meth:`read_log` is)."""
        self._check_readable(name, principal, vocab_size, tokenizer)
        if not 1 <= max_bytes <= MAX_PRIOR_PAGE_BYTES:
            raise InvalidArgument(f"max_bytes must be in [1, {MAX_PRIOR_PAGE_BYTES}], got {max_bytes}")
        if version < 0 or offset < 0:
            raise InvalidArgument(f"version and offset must be >= 0, got {version} and {offset}")
        if version == 0 and offset:
            raise InvalidArgument("a read from an offset names the version it continues")
        if self._persistence is None:
            raise FailedPrecondition("this service keeps no priors in storage: it runs without storage")
        page = self._persistence.prior_page(name, version, offset, max_bytes)
        if page is None:
            if version:
                raise NotFound(f"prior version {version} of namespace {name!r} is gone; read the current one")
            return PriorPage(version=0, size=0, digest="", data=b"")
        if offset > page.size:
            raise InvalidArgument(f"offset {offset} is past the prior's end ({page.size} bytes)")
        return page

    # -- opening sessions --------------------------------------------------------------------

    def open(self, items: list[OpenItem], *, principal: Principal | None = None) -> list[str]:
        """New sessions; an item whose client-chosen id names a live session of the same
        namespace and tenant gets that session back (a repeated open is answered, not doubled).
        :meth:`prepare_open`, :meth:`build_sessions` and :meth:`finish_open` in one go."""
        return self.finish_open(self.prepare_open(items, principal=principal))

    def prepare_open(
        self,
        items: list[OpenItem],
        *,
        principal: Principal | None = None,
        stored: Found | None = None,
        unchecked: bool = False,
    ) -> Opening:
        """The first part of :meth:`open` (on the serving thread): every item checked, nothing
        changed yet. ``stored``: what storage holds of the client-chosen ids this replica does
        not hold (:meth:`open_ids_to_read`, read by :meth:`read_stored`; read here when not
        given): an id another tenant's stored session holds is never opened over. With
        ``unchecked`` (storage could not be read), nothing is known of them: the sessions open
        unchecked, and a write-back that finds another tenant's session under an id ends that
        session here and leaves the other as it is (:meth:`saved`)."""
        if unchecked:
            return self._opener.prepare(items, principal, frozenset(), unchecked=True)
        if stored is None:
            stored = self.read_stored(self.open_ids_to_read(items), build=False)
        claimed = frozenset(
            sid for sid, (found, _) in stored.items() if not owns(principal, found.tenant, found.namespace)
        )
        return self._opener.prepare(items, principal, claimed)

    def open_ids_to_read(self, items: list[OpenItem]) -> list[str]:
        """The ids an open call chose that this replica does not hold (none without storage),
        after the batch size and every id are checked: nothing is read for a call refused."""
        self.admission.batch(len(items))
        chosen = Opener.chosen_ids(items)
        return [] if self._persistence is None else self.not_in_memory(chosen)

    @staticmethod
    def build_sessions(opening: Opening) -> list[Session | None]:
        """The second part of :meth:`open`: the new sessions built (their prompts indexed),
        touching no shared state, so a long prompt can be indexed on a worker thread."""
        return Opener.build(opening)

    def finish_open(self, opening: Opening, sessions: list[Session | None] | None = None) -> list[str]:
        """The last part of :meth:`open` (on the serving thread): the sessions held, their ids
        returned (built now when ``sessions`` is not given)."""
        if sessions is None:
            return self._opener.finish(opening, self.build_sessions(opening), built_now=True)
        return self._opener.finish(opening, sessions, built_now=False)

    # -- drafting, feedback, closing ---------------------------------------------------------

    def draft(
        self, items: Sequence[tuple[str, np.ndarray | list[int]]], *, principal: Principal | None = None
    ) -> list[DraftTree]:
        """For each ``(session_id, new_tokens)``: append the tokens, then draft."""
        return [tree for tree, _ in self.draft_ahead([DraftItem(sid, new) for sid, new in items], principal=principal)]

    def draft_ahead(
        self,
        items: Sequence[DraftItem] | DraftColumns,
        *,
        principal: Principal | None = None,
        read_storage: bool = True,
    ) -> Drafted:
        """Like :meth:`draft`; each item's ``lookahead`` also drafts ahead for that many likely
        outcomes of verifying its tree, unless draft calls keep the process busier than
        ``ahead_busy_limit`` (then none is). New tokens that match an outcome drafted ahead
        continue with the tree the decoder already holds (the subtree the outcome selects)."""
        start = time.perf_counter()
        if isinstance(items, DraftColumns):
            checked, topk = self._checked_columns(items, principal, read_storage)
        else:
            self.admission.batch(len(items))
            ahead = [tokens.lookahead(item.lookahead) for item in items]
            entries = [self._entry(item.session_id, principal, read_storage) for item in items]
            news = [self._new_tokens(entry, item.new_tokens) for entry, item in zip(entries, items, strict=True)]
            rows = zip(items, news, entries, strict=True)
            topk = [tokens.topk_rows(item.topk, new, entry.drafter, item.topk_after) for item, new, entry in rows]
            checked = list(zip(entries, news, ahead, strict=True))
        self.admission.tenant_growth(principal, sum(int(new.size) for _, new, _ in checked))
        drafting.observe_topk(checked, topk)
        spare = self._busy.share(start) <= self.config.ahead_busy_limit
        out = drafting.draft(checked, self.sessions, self._touched, ahead=spare)
        self._drafts += len(out)
        if not spare:
            self._ahead_skipped += sum(1 for _, _, k in checked if k)
        self._busy.add(start, time.perf_counter())
        return out

    def _checked_columns(
        self, cols: DraftColumns, principal: Principal | None, read_storage: bool
    ) -> tuple[list[drafting.Step], list[tokens.TopkPart | None]]:
        """A columnar batch checked whole (shapes, limits, every id in its session's vocabulary)
        and cut into ``(session, new tokens, lookahead)`` items, with each one's top-k rows."""
        self.admission.batch(len(cols.session_ids))
        ahead = tokens.column_shapes(cols)
        if cols.counts.size:
            self.admission.new_tokens(int(cols.counts.max()))
        entries = [self._entry(sid, principal, read_storage) for sid in cols.session_ids]
        news = tokens.column_tokens(cols, entries)
        topk = tokens.column_topk(cols, news, entries)
        return list(zip(entries, news, ahead.tolist(), strict=True)), topk

    def feedback(
        self, items: list[FeedbackItem], *, principal: Principal | None = None, read_storage: bool = True
    ) -> None:
        self.admission.batch(len(items))
        self.admission.branches(
            [len(item.rejected or ()) for item in items],
            lambda: max((len(b) for item in items for _, b in item.rejected or ()), default=0),
        )
        checked: list[drafting.Accepted] = []
        for item in items:
            entry = self._entry(item.session_id, principal, read_storage)
            new = self._new_tokens(entry, item.accepted)
            rejected = None
            if item.rejected is not None:
                rejected = [(off, tokens.checked(b, entry.drafter, "rejected branch")) for off, b in item.rejected]
                if any(not 0 <= off < new.size for off, _ in rejected):
                    raise InvalidArgument("a rejected branch's offset must point inside the accepted tokens")
            checked.append((entry, new, rejected))
        self.admission.tenant_growth(principal, sum(int(new.size) for _, new, _ in checked))
        for part in drafting.rounds(checked):
            drafting.accept(part, self.sessions)
        self._touched([entry for entry, _, _ in checked])

    def close(
        self, items: list[CloseItem], *, principal: Principal | None = None, read_storage: bool = True
    ) -> list[Callable[[], None]]:
        """End sessions now; return what is still to run, in order, before the caller is
        answered, off the request loop: the commits (a commit indexes the request, milliseconds
        of work), then the sessions' stored copies deleted (no replica continues a session
        closed here). A commit that names a key its namespace's log (or, where storage cannot
        tell, this replica) took lately is a retry of one that landed: acknowledged, and neither
        logged nor taken into the lifetime memory again."""
        self.admission.batch(len(items))
        for item in items:
            names.commit_key(item.commit_key)
        entries = []
        for item in items:
            try:
                entries.append((self._entry(item.session_id, principal, read_storage), item))
            except NotFound:
                if not item.missing_ok:
                    raise
        if len({entry.sid for entry, _ in entries}) != len(entries):
            raise InvalidArgument("a close call names each session once")
        checked = [(entry, self._new_tokens(entry, item.new_tokens), None) for entry, item in entries]
        for (entry, item), (_, new, _) in zip(entries, checked, strict=True):
            if not 0 <= item.commit_from <= len(entry.session.context) + new.size:
                raise InvalidArgument(f"commit_from {item.commit_from} is outside the session's context")
        drafting.accept(checked, self.sessions)
        commits: dict[str, list[tuple[SessionEntry, CloseItem]]] = {}
        stored: list[str] = []  # the ids whose stored copies go (see ChangeTracker.closed)
        for entry, item in entries:
            self.sessions.pop(entry.sid)
            if self.changes.closed(entry):
                stored.append(entry.sid)
            if item.commit:
                commits.setdefault(entry.namespace, []).append((entry, item))
        jobs: list[Callable[[], None]] = [partial(self._commit, ns, group) for ns, group in commits.items()]
        if stored and self._persistence is not None:
            jobs.append(partial(self._persistence.sessions_ended, stored))
        return jobs

    def _commit(self, namespace: str, group: list[tuple[SessionEntry, CloseItem]]) -> None:
        """One namespace's commits of a close call, together: one log append, then one index
        run of those the log did not hold already (a client's retries of commits that landed)."""
        drafter = self.namespace(namespace)
        ended = drafter.end_many([(entry.session, item.commit_from) for entry, item in group])
        keys = [item.commit_key for _, item in group]
        committed = Committed([], [False] * len(ended))
        if self._persistence is not None and ended:
            committed = self._persistence.requests_committed(namespace, [e.tokens for e in ended], keys)
        fresh = [
            e
            for e, key, repeated in zip(ended, keys, committed.repeated, strict=True)
            if not repeated and self._recent.first(namespace, key)
        ]
        drafter.remember(fresh)
        self.mark_logged(committed.logged)

    def took_from_log(self, name: str, requests: Requests) -> None:
        """Requests read from the log (other processes' commits) into the namespace's lifetime
        memory (any thread: storage sync calls it). Their keys are recorded as taken: a client's
        late retry of one that reaches this replica while storage is down (journaled, the log
        cannot say it holds it) is not taken a second time."""
        self._recent.took(name, requests.keys)
        if requests.tokens:
            self.namespace(name).memory.commit_many(requests.tokens, requests.ids)

    def _touched(self, entries: Sequence[SessionEntry]) -> None:
        """Sessions used now: most recently used, and changed since storage last took them."""
        self.sessions.touch_many(entries)
        self.changes.changed(entry.sid for entry in entries)

    def _new_tokens(self, entry: SessionEntry, new: np.ndarray | Sequence[int]) -> np.ndarray:
        checked = tokens.checked(new, entry.drafter, "new tokens")
        self.admission.new_tokens(checked.size)
        return checked

    # -- sessions held elsewhere -------------------------------------------------------------

    def _entry(self, sid: str, principal: Principal | None = None, read_storage: bool = True) -> SessionEntry:
        """A live session, or one continued from storage (opened on another replica; without
        ``read_storage``, the caller read storage already). Another tenant's session, or one in
        a namespace the caller may not use, is reported as unknown: its existence is not
        disclosed."""
        try:
            entry = self.sessions.get(sid)
        except NotFound:
            stored = self._continuing.load(sid) if read_storage and self._persistence is not None else None
            if stored is None:
                raise
            return self._continuing.hold(sid, stored, principal)
        if not owns(principal, entry.tenant, entry.namespace):
            raise unknown_session(sid)
        return entry

    def _load(self, sid: str) -> StoredSession | None:
        return None if self._persistence is None else self._persistence.load_session(sid)

    def not_in_memory(self, sids: Iterable[str]) -> list[str]:
        """Which of ``sids`` (once each) this replica does not hold."""
        return [sid for sid in dict.fromkeys(sids) if not self.sessions.holds(sid)]

    def read_stored(self, sids: Sequence[str], *, build: bool = True) -> Found:
        """What storage keeps of ``sids``, each with the session built from it (``build``);
        safe on any thread (see :mod:`~cache_service.domain.continuing`)."""
        return {} if self._persistence is None or not sids else self._continuing.read(sids, build=build)

    def continue_stored(self, found: Found, *, principal: Principal | None = None) -> None:
        """Hold sessions read by :meth:`read_stored` (on the serving thread)."""
        self._continuing.hold_found(found, principal)

    # -- write-behind --------------------------------------------------------------------------

    def take_changes(self, *, final: bool = False, budget_s: float | None = None) -> Changes:
        """Changes of sessions since storage last took them, and ids closed since; on the thread
        that serves requests (see :meth:`ChangeTracker.take`). A round first lets sessions idle
        past the TTL go (a decoder that died never closes its sessions, and a replica no longer
        opening any would otherwise hold them, and count them as open, for good)."""
        if self._orphaned:
            self._end_orphans()
        if not self.changes.taking:
            self.sessions.expire(most=EXPIRE_BATCH)
        return self.changes.take(final=final, budget_s=budget_s)

    @property
    def taking(self) -> bool:
        return self.changes.taking

    def requeue(self, sids: Iterable[str], closed: Iterable[str] = ()) -> None:
        """Put back changes storage could not take (on the serving thread, like take_changes)."""
        self.changes.requeue(sids, closed)

    def saved(self, saved: Saved) -> None:
        """What a write-back did (on the serving thread): sessions it missed are written whole
        next time; a session opened unchecked that storage now holds is checked; one whose id
        storage holds for another tenant ends here (its calls are answered as an unknown
        session's, and the other tenant's session stays as stored)."""
        self.changes.requeue(saved.missed)
        for sid in saved.written:
            entry = self.sessions.find(sid)
            if entry is not None:
                entry.unchecked = False
        for sid in saved.refused:
            entry = self.sessions.find(sid)
            if entry is not None and entry.unchecked:
                self.sessions.discard(sid)
                self.changes.closed(entry)

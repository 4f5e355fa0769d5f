"""Commits on their way to the lifetime log: written at once when storage takes them, else
journaled (fsynced) before the close is answered and replayed when storage returns.

Every commit gets an id, ``(writer, seq)``: the writer is random per process, ``seq`` counts
its commits. The log's append script skips a commit whose ``seq`` is not above the highest one
it recorded for that writer in that namespace, so an append whose answer was lost, replayed
from the journal, lands once. That needs each writer's commits to reach a namespace's log in
``seq`` order: one thread writes at a time (``_write_lock``), a commit goes straight to storage
only when nothing is queued before it, and the queue is kept in ``seq`` order.

A client that never got its close's answer commits the request again, under another session:
the service gives that commit another id. Each commit therefore also carries the key its client
named it with, the same in every retry of the request, and the append script skips a commit
whose key the log recorded lately (:mod:`cache_service.storage.stream_log`), journaled or not.
:meth:`CommitWriter.commit` tells the caller which of its commits the log held already, so the
replica's own lifetime memory takes none of them twice; :attr:`CommitWriter.repeated` counts
the commits skipped either way.

Acknowledged means durable: in Redis, or in the journal. A commit that fits in neither (the
journal full or its disk refusing) is refused with :class:`Unavailable`, never dropped.

With ``replicas``, a commit is acknowledged once that many of the master's replicas have it
(``WAIT``, at most ``wait_ms``): a failover to a replica then loses none. Where fewer confirm in
time, the commit (in the master's log already) is journaled as well and stays there until a
replay's wait confirms it.

Each commit also names the namespace's log it was made for (its identity, read from storage
once per namespace and kept). A namespace deleted meanwhile, and perhaps created again, has
another log, or none: the append refuses such commits and they are dropped, as the deleted
namespace's data is.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from cache_service.domain.errors import Unavailable
from cache_service.domain.ports import Committed, Logged, StorageHealth
from cache_service.host.journal import Journal, JournalError, JournalRecord
from cache_service.storage.errors import StorageError, StorageUnavailable
from cache_service.storage.redis_store import RedisStore
from cache_service.storage.stream_log import Commit, LogReplaced, NotReplicated, position

logger = logging.getLogger(__name__)

FLUSH_BATCH = 256  # queued commits appended to the log per call
_DISK_FULL = ("No space left", "MISCONF", "ENOSPC")  # what Redis or the OS says of a full disk


class _Queued(NamedTuple):
    order: tuple[int, int]  # (writer rank, seq): each writer's commits in seq order
    record: JournalRecord
    since: float  # when it was queued


class _Unconfirmed(Exception):
    """Appended, but fewer replicas than asked confirmed it: ``logged`` is what was appended,
    ``repeated`` per commit whether the log held it already."""

    def __init__(self, logged: Logged, repeated: list[bool], reason: NotReplicated) -> None:
        super().__init__(str(reason))
        self.logged = logged
        self.repeated = repeated


class StorageStatus:
    """Whether the last write reached storage, since when it has not, and why."""

    def __init__(self) -> None:
        self.last_error = ""
        self.down_since: float | None = None
        self.disk_full = False

    @property
    def available(self) -> bool:
        return self.down_since is None

    def failed(self, why: object, *, disk_full: bool | None = None) -> bool:
        """A write failed; ``True`` when storage was available until now. ``disk_full``: what
        the caller knows of the cause; ``None`` reads it from ``why``, and keeps a full disk
        already known for this outage (a Redis that exited on a full disk then refuses
        connections, which says nothing of the disk).

        >>> s = StorageStatus()
        >>> s.failed("embedded Redis died", disk_full=True), s.failed("Connection refused"), s.disk_full
        (True, False, True)
        >>> s.succeeded() is not None, s.failed("Connection refused"), s.disk_full
        (True, True, False)
        """
        self.last_error = str(why)
        if disk_full is None:
            known = self.down_since is not None and self.disk_full
            disk_full = known or any(s in self.last_error for s in _DISK_FULL)
        self.disk_full = disk_full
        if self.down_since is None:
            self.down_since = time.monotonic()
            return True
        return False

    def succeeded(self) -> float | None:
        """A write reached storage; how long it was unavailable, if it was until now."""
        if self.down_since is None:
            return None
        down, self.down_since, self.disk_full = time.monotonic() - self.down_since, None, False
        return down


class CommitWriter:
    """Appends commits to ``store``'s lifetime logs, through ``journal`` while it cannot;
    ``max_pending`` bounds the commits held in memory meanwhile. ``direct``: the store a
    close's own commits are appended through (short timeouts: past them they are journaled,
    and the replay appends any that landed once); ``store`` by default, which replays."""

    def __init__(
        self,
        store: RedisStore,
        *,
        max_pending: int,
        journal: Journal | None = None,
        on_written: Callable[[Logged], None] | None = None,
        on_journaled: Callable[[list[JournalRecord]], None] | None = None,
        direct: RedisStore | None = None,
        replicas: int = 0,
        wait_ms: int = 1000,
    ) -> None:
        if replicas < 0 or wait_ms < 1:
            raise ValueError(f"replicas must be >= 0 and wait_ms >= 1, got {replicas} and {wait_ms}")
        self.store = store
        self._direct = direct or store
        self._replicas, self._wait_ms = replicas, wait_ms
        self._logs: dict[str, str] = {}  # per namespace, the identity of its log
        self._on_written = on_written
        self._on_journaled = on_journaled  # this process's commits, queued (not known to the log yet)
        self.journal = journal
        self.status = StorageStatus()
        self.writer = os.urandom(16)
        self._seq = itertools.count()
        self._ranks: dict[bytes, int] = {}
        self._queue: list[_Queued] = []
        self._max_pending = max_pending
        self._lock = threading.Lock()  # the queue, the journal, the counter
        self._write_lock = threading.Lock()  # one writer of the log at a time, in seq order
        self.repeated = 0  # commits the log held already, by id or by key (not appended again)
        # Held by a reader that must not see this process's entries before ``on_written`` did.
        self.writing = self._write_lock

    @property
    def pending(self) -> int:
        return len(self._queue)

    def oldest_pending_age_s(self) -> float:
        with self._lock:
            return time.monotonic() - min(q.since for q in self._queue) if self._queue else 0.0

    def recover(self) -> int:
        """Queue what the journal holds from earlier runs (replayed by the next :meth:`flush`)."""
        if self.journal is None:
            return 0
        records = self.journal.open()
        with self._lock:
            for r in records:
                self._insert(r, time.monotonic())
        return len(records)

    def health(self) -> StorageHealth:
        s, j = self.status, self.journal
        return StorageHealth(
            available=s.available,
            last_error=s.last_error,
            unavailable_seconds=0.0 if s.down_since is None else time.monotonic() - s.down_since,
            journaled_commits=self.pending,
            journal_bytes=0 if j is None else j.size_bytes,
            journal_capacity_bytes=0 if j is None else j.capacity_bytes,
            disk_full=s.disk_full,
            repeated_commits=self.repeated,
        )

    def forget(self, namespace: str) -> None:
        """The namespace was deleted (or created again): its log's identity is read afresh."""
        self._logs.pop(namespace, None)

    def _log(self, namespace: str) -> str:
        """The identity of the namespace's log ("" while storage cannot tell)."""
        log = self._logs.get(namespace)
        if log is None:
            try:
                log = self._logs[namespace] = self._direct.log_identity(namespace)
            except StorageError:
                return ""
        return log

    def commit(self, namespace: str, requests: list[np.ndarray], keys: Sequence[str] = ()) -> Committed:
        """Write ``requests`` (``keys``: the key each one's client named it with, "" or none:
        no key) now if storage takes them, else journal them; returns what reached the log, and
        which of them it held already. :class:`Unavailable` when neither could take them
        (nothing acknowledged)."""
        log = self._log(namespace) if self.status.available else self._logs.get(namespace, "")
        unknown = Committed([], [False] * len(requests))
        if not self._write_lock.acquire(blocking=False):  # another write is under way: no waiting
            with self._lock:
                self._journal(self._records(namespace, requests, log, keys))
            return unknown
        try:
            with self._lock:
                records = self._records(namespace, requests, log, keys)
                if self._queue:  # others wait before them: after those
                    self._journal(records)
                    records = []
            if records:
                try:
                    logged, repeated = self._append(namespace, records, self._direct)
                    return Committed([logged], repeated)
                except LogReplaced as exc:
                    self._replaced(namespace, len(records), exc)
                    return unknown
                except _Unconfirmed as exc:  # in the log, but a failover could lose it: journaled too
                    self.note_failure(exc)
                    with self._lock:
                        self._journal(records)
                    return Committed([exc.logged], exc.repeated)
                except StorageError as exc:
                    self.note_failure(exc)
                    with self._lock:
                        self._journal(records)
                    return unknown
            return unknown._replace(logged=self._flush() if self.status.available else [])
        except StorageError:
            return unknown  # journaled; the next flush retries
        finally:
            self._write_lock.release()

    def flush(self) -> list[Logged]:
        """Write queued commits in order, each run of one namespace's in one append; what was
        written. ``StorageError`` when storage fails (what is still queued stays queued)."""
        with self._write_lock:
            return self._flush()

    def _flush(self) -> list[Logged]:
        logged: list[Logged] = []
        if not self._queue and not self.status.available:  # nothing to write: is it back?
            try:
                self.store.ping()
            except StorageError as exc:
                self.note_failure(exc)
                raise
            self._recovered()
        while True:
            with self._lock:
                run = self._head_run()
            if not run:
                return logged
            try:
                if self.store.namespace_registered(run[0].namespace):
                    logged.append(self._append(run[0].namespace, run)[0])
                else:  # deleted meanwhile: its commits would make an orphan log of it
                    logger.warning("%d queued commits of deleted namespace %s dropped", len(run), run[0].namespace)
            except LogReplaced as exc:
                self._replaced(run[0].namespace, len(run), exc)
            except _Unconfirmed as exc:  # kept until a later replay's wait confirms them
                self.note_failure(exc)
                raise StorageUnavailable(str(exc)) from exc
            except StorageError as exc:
                self.note_failure(exc)
                raise
            with self._lock:
                del self._queue[: len(run)]
                if self.journal is not None:
                    self.journal.drained([q.record for q in self._queue])

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    def _records(
        self, namespace: str, requests: list[np.ndarray], log: str = "", keys: Sequence[str] = ()
    ) -> list[JournalRecord]:
        keys = keys or [""] * len(requests)
        return [
            JournalRecord(self.writer, next(self._seq), namespace, tokens, log, key)
            for tokens, key in zip(requests, keys, strict=True)
        ]

    def _replaced(self, namespace: str, count: int, exc: LogReplaced) -> None:
        logger.warning("%d commits dropped: %s (the namespace was deleted since)", count, exc)
        self.forget(namespace)

    def _append(
        self, ns: str, records: list[JournalRecord], store: RedisStore | None = None
    ) -> tuple[Logged, list[bool]]:
        """Append ``records`` once each: what reached the log, and per record whether the log
        held it already."""
        commits = [Commit(r.writer, r.seq, r.tokens, r.key) for r in records]
        unconfirmed = None
        try:
            ids = (store or self.store).append_commits(
                ns, commits, log=records[0].log, replicas=self._replicas, wait_ms=self._wait_ms
            )
            self._recovered()
        except NotReplicated as exc:
            ids, unconfirmed = exc.ids, exc
        repeated = [i is None for i in ids]
        self.repeated += sum(repeated)
        # A previous run's journaled commits are not in this process's memory: left out, the
        # log's followers read them like any other process's.
        mine = [(r.tokens, position(i)) for r, i in zip(records, ids, strict=True) if i and r.writer == self.writer]
        logged = (ns, [t for t, _ in mine], [p for _, p in mine])
        if self._on_written is not None:
            self._on_written(logged)
        if unconfirmed is not None:
            raise _Unconfirmed(logged, repeated, unconfirmed)
        return logged, repeated

    def _journal(self, records: list[JournalRecord]) -> None:
        """Make ``records`` durable in the journal and queue them (caller holds ``_lock``)."""
        if len(self._queue) + len(records) > self._max_pending:
            raise Unavailable(f"{len(self._queue)} commits are waiting for storage; try again later")
        if self.journal is not None:
            try:
                self.journal.append(records)
            except JournalError as exc:
                self.note_failure(exc, disk_full=exc.disk_full)
                logger.error("commit refused, not acknowledged: %s", exc)
                raise Unavailable(f"storage unavailable and {exc}") from exc
        now = time.monotonic()
        for r in records:
            self._insert(r, now)
        if self._on_journaled is not None:
            self._on_journaled(records)

    def _insert(self, record: JournalRecord, now: float) -> None:
        rank = self._ranks.setdefault(record.writer, len(self._ranks))
        bisect.insort(self._queue, _Queued((rank, record.seq), record, now), key=lambda q: q.order)

    def _head_run(self) -> list[JournalRecord]:
        """The first queued commits of one namespace's log, up to :data:`FLUSH_BATCH`."""
        if not self._queue:
            return []
        head = self._queue[0].record
        run = itertools.takewhile(
            lambda q: (q.record.namespace, q.record.log) == (head.namespace, head.log),
            itertools.islice(self._queue, FLUSH_BATCH),
        )
        return [q.record for q in run]

    def _recovered(self) -> None:
        down = self.status.succeeded()
        if down is not None:
            logger.warning("storage available again after %.1f s; %d journaled commits to replay", down, self.pending)

    def note_failure(self, exc: Exception, *, disk_full: bool | None = None) -> None:
        """A write to storage failed (a commit's, or another the caller made): commits are
        journaled until a flush finds storage back."""
        if self.status.failed(exc, disk_full=disk_full):
            logger.warning("storage unavailable, commits are journaled until it returns: %s", exc)

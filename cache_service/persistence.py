"""Keeping a service's memory and Redis in step.

Commits are written behind (a bounded queue drained by the sync job), so closing a request never
waits on Redis; while Redis is down they stay queued and are flushed when it returns. The same
job follows the lifetime log for requests other replicas committed, skipping its own entries,
and reloads a namespace's static prior when a new version is published. With
:class:`~cache_service.host.shared_indexes.SharedIndexes` the processes of a host share one build of
the lifetime indexes, and each keeps only the requests past the shared generation.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from cache_service.domain.errors import Unavailable
from cache_service.domain.service import DraftService, SessionChange, SessionDelta
from cache_service.host import prior_files
from cache_service.host.shared_indexes import SharedIndexes
from cache_service.storage.errors import StorageError, StorageUnavailable
from cache_service.storage.redis_store import RedisStore
from cache_service.storage.sessions import SessionAppend, SessionWrite
from cache_service.storage.stored_session import StoredSession
from cache_service.storage.stream_log import position, stream_id
from indexer.lifetime_index import LifetimeIndexes, LogId
from indexer.prior import StaticPrior

logger = logging.getLogger(__name__)

SAVE_BATCH = 256  # sessions written per pipelined round trip
FLUSH_BATCH = 256  # queued commits appended to the log per call


class RedisPersistence:
    """The service's :class:`~cache_service.domain.service.Persistence` on a :class:`RedisStore`."""

    def __init__(
        self,
        store: RedisStore,
        *,
        max_pending: int,
        prior_dir: Path | None = None,
        shared: SharedIndexes | None = None,
    ) -> None:
        self.store = store
        self._prior_dir = prior_dir  # priors saved here once and memory-mapped (shared by processes)
        self.shared = shared  # lifetime indexes built once per host and mapped (shared by processes)
        self._service: DraftService | None = None
        self._pending: deque[tuple[str, np.ndarray, float]] = deque()  # with the time queued
        self._max_pending = max_pending
        self._own: set[str] = set()  # ids of entries this process appended
        self._last: dict[str, str] = {}  # per namespace: the last log entry applied
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._prior_lock = threading.Lock()  # the schedule and an admin rebuild may both reload

    @property
    def pending(self) -> int:
        return len(self._pending)

    def oldest_pending_age_s(self) -> float:
        """How long the oldest unwritten commit has waited (0 when none is waiting)."""
        with self._lock:
            return time.monotonic() - self._pending[0][2] if self._pending else 0.0

    # -- Persistence ---------------------------------------------------------------------------

    def namespace_created(self, name: str, vocab_size: int) -> None:
        try:
            self.store.register_namespace(name, vocab_size)
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc

    def requests_committed(self, namespace: str, requests: list[np.ndarray]) -> None:
        """Queue commits and try to write them now, so they are durable when the caller is
        answered; if storage is down they stay queued for the sync job."""
        with self._lock:
            if len(self._pending) + len(requests) > self._max_pending:
                raise Unavailable(f"{len(self._pending)} commits are waiting for storage; try again later")
            now = time.monotonic()
            self._pending.extend((namespace, tokens, now) for tokens in requests)
        with self._sync_lock:
            try:
                self._flush()
            except StorageError as exc:
                logger.warning("commit queued until storage returns (%d queued): %s", len(self._pending), exc)

    def load_session(self, sid: str) -> StoredSession | None:
        try:
            return self.store.load_session(sid)
        except StorageUnavailable as exc:
            raise Unavailable(f"storage unavailable: {exc}") from exc

    def save_sessions(self, changed: list[tuple[str, SessionChange]], closed: list[str], ttl_s: float) -> list[str]:
        """Write session changes and drop closed sessions. A whole session is one transaction
        (state and rejected table); a :class:`SessionDelta` appends its tokens (and replaces the
        rejected table when given) only where storage holds exactly the context it extends.
        Returns the sessions where it did not (expired or lost meanwhile): write them whole."""
        writes: list[SessionWrite] = []
        appends: list[SessionAppend] = []
        for sid, change in changed:
            if isinstance(change, SessionDelta):
                appends.append((sid, change.held, change.tokens, change.rejected))
                continue
            writes.append((sid, change))
        for start in range(0, len(writes), SAVE_BATCH):  # pipelined, a bounded batch per round trip
            self.store.save_sessions(writes[start : start + SAVE_BATCH], ttl_s)
        missed: list[str] = []
        for start in range(0, len(appends), SAVE_BATCH):
            batch = appends[start : start + SAVE_BATCH]
            applied = self.store.append_sessions(batch, ttl_s)
            missed.extend(sid for (sid, *_), ok in zip(batch, applied, strict=True) if not ok)
        for start in range(0, len(closed), SAVE_BATCH):
            self.store.delete_sessions(closed[start : start + SAVE_BATCH])
        return missed

    # -- start-up and the periodic sync --------------------------------------------------------

    def restore(self, service: DraftService) -> None:
        """Namespaces, lifetime logs and priors from storage into a fresh service."""
        self._service = service
        for name, vocab in sorted(self.store.namespaces().items()):
            drafter = service.create_namespace(name, vocab, persist=False)
            after = "0"
            if self.shared is not None:  # map the host's generation; build one first if there is none
                self.shared.publish(name, wait=True, only_if_missing=True)
                gen = self.shared.adopt(name, drafter.memory, threads=drafter.threads)
                after = "0" if gen is None else stream_id(gen.through)
            requests, ids = self._read_all(name, after)
            drafter.memory.commit_many(requests, ids)
            if requests and self.shared is None:
                drafter.memory.rebuild()
            self._load_prior(service, name)
            logger.info(
                "restored namespace %s: %d requests, %d tokens", name, len(requests), drafter.memory.buffered_tokens
            )

    def _read_all(self, ns: str, after: str) -> tuple[list[np.ndarray], list[LogId]]:
        out: list[np.ndarray] = []
        ids: list[LogId] = []
        last = after
        while True:
            entries = self.store.read_log(ns, after_id=last)
            if not entries:
                break
            out.extend(np.array(e.tokens, dtype=np.int32) for e in entries)
            ids.extend(position(e.id) for e in entries)
            last = entries[-1].id
        self._last[ns] = last
        return out, ids

    # -- lifetime indexes ----------------------------------------------------------------------

    def rebuild(self, service: DraftService, name: str, *, wait: bool = False) -> LifetimeIndexes | None:
        """Rebuild a namespace's lifetime indexes; returns what this process built. With shared
        indexes, the process holding the build lock builds and publishes and the others map
        the result (each then serves the newest generation); ``wait``: wait for a build under
        way in another process, then build what it did not cover."""
        memory = service.namespace(name).memory
        if self.shared is None:
            return memory.rebuild()
        built = self.shared.publish(name, wait=wait)
        self._adopt(service, name)
        return built

    def adopt_published(self, service: DraftService) -> None:
        """Serve generations other processes published (shared indexes only)."""
        if self.shared is None:
            return
        for name in service.namespace_names():
            try:
                self._adopt(service, name)
            except StorageError as exc:
                logger.warning("lifetime generation check for %s deferred: %s", name, exc)

    def _adopt(self, service: DraftService, name: str) -> None:
        assert self.shared is not None
        drafter = service.namespace(name)
        gen = self.shared.adopt(name, drafter.memory, threads=drafter.threads)
        if gen is None:
            return
        with self._sync_lock:  # entries the generation covers need not be read from the log again
            if position(self._last.get(name, "0")) < gen.through:
                self._last[name] = stream_id(gen.through)
                with self._lock:
                    self._own = {i for i in self._own if position(i) > gen.through}

    def sync(self, service: DraftService) -> None:
        """Flush queued commits, then apply other replicas' new ones. Storage errors are logged
        and retried on the next run; nothing queued is dropped."""
        with self._sync_lock:
            try:
                self._flush()
                self._discover(service)
                for name in service.namespace_names():
                    self._follow(service, name)
            except StorageError as exc:
                logger.warning("storage sync deferred (%d commits queued): %s", len(self._pending), exc)

    def _discover(self, service: DraftService) -> None:
        """Namespaces registered by another replica or by ``draftcache warm``."""
        known = set(service.namespace_names())
        for name, vocab in self.store.namespaces().items():
            if name not in known:
                service.create_namespace(name, vocab, persist=False)

    def _flush(self) -> None:
        """Write queued commits in order, each run of one namespace's in one append."""
        while self._pending:
            with self._lock:
                ns = self._pending[0][0]
                run = []
                for pending in itertools.islice(self._pending, FLUSH_BATCH):
                    if pending[0] != ns:
                        break
                    run.append(pending)
            requests = [tokens for _, tokens, _ in run]
            ids = self.store.append_requests(ns, requests)
            with self._lock:
                self._own.update(ids)
                for _ in run:
                    self._pending.popleft()
            if self.shared is not None and self._service is not None:  # where they fall in the log
                memory = self._service.namespace(ns).memory
                for tokens, log_id in zip(requests, ids, strict=True):
                    memory.mark_logged(tokens, position(log_id))

    def _follow(self, service: DraftService, ns: str) -> None:
        entries = self.store.read_log(ns, after_id=self._last.get(ns, "0"))
        if not entries:
            return
        covered = None if self.shared is None else self.shared.adopted(ns)
        theirs, ids = [], []
        for entry in entries:
            if entry.id in self._own:
                self._own.discard(entry.id)
            elif covered is None or position(entry.id) > covered:
                theirs.append(np.array(entry.tokens, dtype=np.int32))
                ids.append(position(entry.id))
        if theirs:
            service.namespace(ns).memory.commit_many(theirs, ids)
        self._last[ns] = entries[-1].id

    def reload_priors(self, service: DraftService) -> None:
        try:
            self._discover(service)
        except StorageError as exc:
            logger.warning("namespace discovery deferred: %s", exc)
        with self._prior_lock:
            for name in service.namespace_names():
                try:
                    version = self.store.prior_version(name)
                    if version is not None and version != service.prior_version(name):
                        self._load_prior(service, name)
                except (StorageError, ValueError) as exc:
                    logger.warning("prior reload for %s deferred: %s", name, exc)

    def _load_prior(self, service: DraftService, name: str) -> None:
        if self._prior_dir is not None:
            version = self.store.prior_version(name)
            if version is not None and prior_files.folder_for(self._prior_dir, name, version).exists():
                self._set_mapped(service, name, version)
                return
        found = self.store.get_prior(name)
        if found is None:
            return
        version, blob = found
        prior = StaticPrior.from_bytes(bytes(blob))
        if self._prior_dir is None:
            service.set_prior(name, prior, version)
        else:
            prior_files.save(prior, prior_files.folder_for(self._prior_dir, name, version))
            del prior, blob
            self._set_mapped(service, name, version)
        logger.info("namespace %s: static prior version %d loaded", name, version)

    def _set_mapped(self, service: DraftService, name: str, version: int) -> None:
        prior = prior_files.load(prior_files.folder_for(self._prior_dir or Path(), name, version))
        service.set_prior(name, prior, version)
        logger.info("namespace %s: static prior version %d mapped from %s", name, version, self._prior_dir)

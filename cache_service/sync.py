"""Keeping a service's memory and Redis in step: what the background jobs and start-up do.

:class:`~cache_service.persistence.RedisPersistence` reads and writes Redis and hands back
data; this applies it to the :class:`~cache_service.domain.service.DraftService`: namespaces and
lifetime logs restored at start-up, queued commits flushed, requests other replicas committed
followed, a namespace's static prior reloaded when a new version is published, lifetime indexes
rebuilt. With :class:`~cache_service.host.shared_indexes.SharedIndexes` the processes of a host
share one build of the lifetime indexes, and each keeps only the requests past the shared
generation. None of it runs on the serving thread: draft and feedback calls never wait on it.
"""

from __future__ import annotations

import logging
import shutil
import threading

import numpy as np

from cache_service.domain.service import DraftService
from cache_service.host import lifetime_files, prior_files
from cache_service.host.shared_indexes import SharedIndexes
from cache_service.persistence import RedisPersistence
from cache_service.storage.errors import StorageError
from indexer.lifetime_index import LifetimeIndexes

logger = logging.getLogger(__name__)


class StorageSync:
    """Applies what ``persistence`` reads to ``service``; ``shared``: lifetime indexes built once
    per host and mapped by every process."""

    def __init__(self, service: DraftService, persistence: RedisPersistence, shared: SharedIndexes | None) -> None:
        self.service = service
        self.persistence = persistence
        self.shared = shared
        self._prior_lock = threading.Lock()  # the schedule and an admin rebuild may both reload
        self._deferred = False  # the last sync failed (said once per outage)
        self._registered: set[str] = set()  # namespaces the registry held when last read

    # -- start-up ------------------------------------------------------------------------------

    def restore(self) -> None:
        """Journaled commits into the log, then namespaces, lifetime logs and priors from
        storage into a fresh service."""
        try:
            self.persistence.flush()
        except StorageError as exc:
            logger.warning("journaled commits not replayed yet (%d): %s", self.persistence.pending, exc)
        registered = self.persistence.namespaces()
        self._registered = set(registered)
        for name, vocab in sorted(registered.items()):
            drafter = self.service.create_namespace(name, vocab, persist=False)
            after = None
            if self.shared is not None:  # map the host's generation; build one first if there is none
                self.shared.publish(name, wait=True, only_if_missing=True)
                gen = self.shared.adopt(name, drafter.memory, threads=drafter.threads)
                after = None if gen is None else gen.through
            requests, ids = self.persistence.read_log(name, after)
            drafter.memory.commit_many(requests, ids)
            if requests and self.shared is None:
                drafter.memory.rebuild()
            self._load_prior(name)
            self._load_successors(name, *self.persistence.read_successors(name))
            logger.info(
                "restored namespace %s: %d requests, %d tokens", name, len(requests), drafter.memory.buffered_tokens
            )

    # -- the periodic jobs ---------------------------------------------------------------------

    def sync(self) -> None:
        """Replay journaled commits, then apply other replicas' new ones. Storage errors are
        logged (once per outage) and retried on the next run; nothing journaled is dropped."""
        try:
            self.service.mark_logged(self.persistence.flush())
            self._discover()
            for name in self.service.namespace_names():
                covered = None if self.shared is None else self.shared.adopted(name)
                requests, ids = self.persistence.follow(name, covered)
                if requests:
                    self.service.namespace(name).memory.commit_many(requests, ids)
                self._share_successors(name)
        except StorageError as exc:
            if not self._deferred:
                logger.warning("storage sync deferred (%d commits journaled): %s", self.persistence.pending, exc)
            self._deferred = True
        else:
            if self._deferred:
                logger.info("storage sync resumed; journaled commits replayed")
            self._deferred = False

    def _share_successors(self, name: str) -> None:
        """Write the successor rows changed here, then take those other replicas changed."""
        table = self.service.namespace(name).successors
        tokens, packed = table.take_changed()
        try:
            self.persistence.save_successors(name, tokens, packed)
        except StorageError:
            table.mark_changed(tokens)  # written on the next run
            raise
        self._load_successors(name, *self.persistence.successor_changes(name))

    def _load_successors(self, name: str, tokens: np.ndarray, packed: list[bytes]) -> None:
        if not tokens.size:
            return
        try:
            self.service.namespace(name).successors.load(tokens, packed)
        except ValueError as exc:  # a damaged row: the table keeps its own rows
            logger.warning("namespace %s: successor rows from storage skipped: %s", name, exc)

    def _discover(self) -> None:
        """Namespaces registered by another replica or by ``draftcache warm``, and those deleted
        since the registry was last read (by any replica, this one included)."""
        known = set(self.service.namespace_names())
        registered = self.persistence.namespaces()
        for name, vocab in registered.items():
            if name not in known:
                self.service.create_namespace(name, vocab, persist=False)
        for name in sorted(self._registered - registered.keys()):
            self._forget(name)
        self._registered = set(registered)

    def _forget(self, name: str) -> None:
        """A deleted namespace: dropped from the service, and its files on this host removed
        (a process still mapping one keeps its pages until it lets go)."""
        self.service.forget_namespace(name)
        folders = []
        if self.persistence.prior_dir is not None:  # a prior's versions are folders in the namespace's
            folders.append(prior_files.folder_for(self.persistence.prior_dir, name, 0).parent)
        if self.shared is not None:
            folders.append(lifetime_files.namespace_dir(self.shared.root, name))
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        logger.info("namespace %s deleted: dropped, and its files on this host removed", name)

    def reload_priors(self) -> None:
        """Load every namespace's prior whose published version is not the one served."""
        try:
            self._discover()
        except StorageError as exc:
            logger.warning("namespace discovery deferred: %s", exc)
        with self._prior_lock:
            for name in self.service.namespace_names():
                try:
                    version = self.persistence.prior_version(name)
                    if version is not None and version != self.service.prior_version(name):
                        self._load_prior(name)
                except (StorageError, ValueError) as exc:  # ValueError: a published blob that does not parse
                    logger.warning("prior reload for %s deferred: %s", name, exc)

    def _load_prior(self, name: str) -> None:
        found = self.persistence.load_prior(name)
        if found is not None:
            prior, version = found
            self.service.set_prior(name, prior, version)
            logger.info("namespace %s: static prior version %d loaded", name, version)

    # -- lifetime indexes ----------------------------------------------------------------------

    def rebuild(self, name: str, *, wait: bool = False) -> LifetimeIndexes | None:
        """Rebuild a namespace's lifetime indexes; returns what this process built. With shared
        indexes, the process holding the build lock builds and publishes and the others map
        the result (each then serves the newest generation); ``wait``: wait for a build under
        way in another process, then build what it did not cover."""
        memory = self.service.namespace(name).memory
        if self.shared is None:
            return memory.rebuild()
        built = self.shared.publish(name, wait=wait)
        self._adopt(name)
        return built

    def refresh(self, names: list[str]) -> None:
        """The admin rebuild: published priors reloaded and the named namespaces rebuilt now
        (after a build under way in another process)."""
        self.reload_priors()
        for name in names:
            self.rebuild(name, wait=True)

    def adopt_published(self) -> None:
        """Serve generations other processes published (shared indexes only)."""
        if self.shared is None:
            return
        for name in self.service.namespace_names():
            try:
                self._adopt(name)
            except StorageError as exc:
                logger.warning("lifetime generation check for %s deferred: %s", name, exc)

    def _adopt(self, name: str) -> None:
        assert self.shared is not None
        drafter = self.service.namespace(name)
        gen = self.shared.adopt(name, drafter.memory, threads=drafter.threads)
        if gen is not None:  # entries the generation covers need not be read from the log again
            self.persistence.skip_to(name, gen.through)

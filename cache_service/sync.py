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
import time

import numpy as np

from cache_service.domain.errors import AlreadyExists
from cache_service.domain.service import DraftService
from cache_service.host import lifetime_files, prior_files
from cache_service.host.shared_indexes import SharedIndexes
from cache_service.persistence import RedisPersistence
from cache_service.storage.errors import StorageError
from indexer.drafter import NamespaceDrafter
from indexer.lifetime_index import LifetimeIndexes

logger = logging.getLogger(__name__)

# How long a namespace created here may go unseen in the registry before it is taken for
# deleted elsewhere: longer than its registration can take (a 30 s socket timeout, one retry).
REGISTRATION_GRACE_S = 120.0


class StorageSync:
    """Applies what ``persistence`` reads to ``service``; ``shared``: lifetime indexes built once
    per host and mapped by every process."""

    def __init__(self, service: DraftService, persistence: RedisPersistence, shared: SharedIndexes | None) -> None:
        self.service = service
        self.persistence = persistence
        self.shared = shared
        self._prior_lock = threading.Lock()  # the schedule and an admin rebuild may both reload
        self._deferred = False  # the last sync failed (said once per outage)
        self._discover_lock = threading.Lock()  # the sync and the prior reload both discover
        # Per namespace, the drafter a registry read confirmed: it served the name before the
        # read began, and the read held the name with its vocabulary (or the sync created it).
        self._registered: dict[str, NamespaceDrafter] = {}
        # Drafters created here that reads have not held yet, and when a read first missed them.
        self._unseen: dict[str, tuple[NamespaceDrafter, float]] = {}
        self._refused: dict[str, tuple[NamespaceDrafter, int]] = {}  # prior versions not served
        # Per namespace, the identity of the log its drafter was made from: another one in
        # storage means the namespace was deleted and created again (the same vocabulary or not).
        self._logs: dict[str, tuple[NamespaceDrafter, str]] = {}
        self.registration_grace_s = REGISTRATION_GRACE_S

    # -- start-up ------------------------------------------------------------------------------

    def restore(self) -> None:
        """Journaled commits into the log, then namespaces, lifetime logs and priors from
        storage into a fresh service."""
        try:
            self.persistence.flush()
        except StorageError as exc:
            logger.warning("journaled commits not replayed yet (%d): %s", self.persistence.pending, exc)
        registered = self.persistence.namespaces()
        logs = self.persistence.log_identities(sorted(registered))  # before any log is read
        for name, vocab in sorted(registered.items()):
            drafter = self.service.create_namespace(name, vocab, persist=False)
            self._registered[name] = drafter
            self._seen_log(name, drafter, logs[name])
            after = None
            if self.shared is not None:  # map the host's generation; build one first if there is none
                try:
                    self.shared.publish(name, wait=True, only_if_missing=True)
                    gen = self.shared.adopt(name, drafter.memory, threads=drafter.threads)
                    after = None if gen is None else gen.through
                except OSError as exc:  # a full disk, say: the log is served from memory until a rebuild
                    logger.error(
                        "namespace %s: lifetime generation not built (the rebuild job tries again): %s", name, exc
                    )
            requests = self.persistence.read_log(name, after)
            self.service.took_from_log(name, requests)
            if requests.tokens and self.shared is None:
                drafter.memory.rebuild()
            try:
                self._load_prior(name)
            except (ValueError, OSError) as exc:  # a blob that does not parse, a folder not written
                logger.error("namespace %s: static prior not loaded (the reload job tries again): %s", name, exc)
            self._load_successors(name, *self.persistence.read_successors(name))
            tokens = drafter.memory.buffered_tokens
            logger.info("restored namespace %s: %d requests, %d tokens", name, len(requests.tokens), tokens)
        self._learn_tokenizers(self._registered)

    # -- the periodic jobs ---------------------------------------------------------------------

    def sync(self) -> None:
        """Replay journaled commits, then apply other replicas' new ones. Storage errors are
        logged (once per outage) and retried on the next run; nothing journaled is dropped."""
        try:
            self.service.mark_logged(self.persistence.flush())
            self._discover()
            for name in self.service.namespace_names():
                covered = None if self.shared is None else self.shared.adopted(name)
                self.service.took_from_log(name, self.persistence.follow(name, covered))
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
        since the registry was last read (by any replica, this one included).

        A registry read is older than what happens here after it began, so the drafters serving
        then are taken first and only those are judged by it: a namespace deleted and created
        again here meanwhile is never forgotten for a read that missed the new one, while one
        the registry holds with another vocabulary (deleted and created again elsewhere) is
        replaced, and so is one whose log is another than the one its drafter was made from
        (deleted and created again elsewhere with the same vocabulary)."""
        with self._discover_lock:
            before = self.service.namespaces.drafters()
            registered = self.persistence.namespaces()
            logs = self.persistence.log_identities(sorted(registered.keys() & before.keys()))
            read_at = time.monotonic()
            confirmed: dict[str, NamespaceDrafter] = {}
            for name, vocab in registered.items():
                drafter = before.get(name)
                if drafter is not None and (
                    drafter.namespace.vocab_size != vocab or not self._seen_log(name, drafter, logs[name])
                ):
                    self._forget(name, drafter)
                    drafter = None
                found = drafter or self._create(name, vocab)
                if found is not None:
                    confirmed[name] = found
            self._learn_tokenizers(confirmed)
            unseen: dict[str, tuple[NamespaceDrafter, float]] = {}
            for name, drafter in before.items():
                if name not in registered and self._deleted(name, drafter, read_at, unseen):
                    self._forget(name, drafter)
            serving = self.service.namespaces.drafters()
            for name, drafter in self._registered.items():
                if serving.get(name) is not drafter:  # deleted here (created again, perhaps)
                    self._remove_files(name, lifetime=name not in serving)
            self._registered, self._unseen = confirmed, unseen
            self._refused = {n: r for n, r in self._refused.items() if serving.get(n) is r[0]}  # no hold on the gone
            self._logs = {n: seen for n, seen in self._logs.items() if serving.get(n) is seen[0]}

    def _learn_tokenizers(self, confirmed: dict[str, NamespaceDrafter]) -> None:
        """The registered tokenizer of each namespace served without one (registered once, it
        stays until the namespace is deleted: those known are not read again)."""
        unknown = sorted(n for n in confirmed if not self.service.namespaces.tokenizer(n))
        for name, fingerprint in self.persistence.tokenizers(unknown).items():
            if fingerprint:
                self.service.namespaces.set_tokenizer(name, confirmed[name], fingerprint)

    def _seen_log(self, name: str, drafter: NamespaceDrafter, log: str | None) -> bool:
        """Whether ``log`` (the namespace's log identity in storage now) may be the one
        ``drafter`` was made from: the one it was first seen with, or the first seen (a log
        gets its identity on first use)."""
        seen = self._logs.get(name)
        if seen is not None and seen[0] is drafter:
            return log == seen[1]
        if log is not None:
            self._logs[name] = (drafter, log)
        return True

    def _deleted(
        self, name: str, drafter: NamespaceDrafter, read_at: float, unseen: dict[str, tuple[NamespaceDrafter, float]]
    ) -> bool:
        """Whether ``drafter``, serving ``name`` before a registry read (at ``read_at``) that did
        not hold the name, is of a deleted namespace: it is when an earlier read held it, or when
        reads have missed it since longer than a registration can take (created here, it was
        deleted elsewhere before any read saw it); until then it is kept in ``unseen``."""
        if self._registered.get(name) is drafter:
            return True
        held, since = self._unseen.get(name, (drafter, read_at))
        if held is not drafter:
            since = read_at
        if read_at - since >= self.registration_grace_s:
            return True
        unseen[name] = (drafter, since)
        return False

    def _create(self, name: str, vocab: int) -> NamespaceDrafter | None:
        """The drafter of a namespace the registry holds; ``None`` while this replica serves the
        name with another vocabulary (created here after the read: the next read settles it)."""
        try:
            return self.service.create_namespace(name, vocab, persist=False)
        except AlreadyExists:
            return None

    def _forget(self, name: str, drafter: NamespaceDrafter) -> None:
        """A deleted namespace: dropped from the service, and its files on this host removed
        (a process still mapping one keeps its pages until it lets go). Only while ``drafter``
        still serves it: a namespace deleted and created again here meanwhile is another one."""
        with self.service.namespaces.unchanged():
            if not self.service.namespaces.current(name, drafter):
                return
            self.service.forget_namespace(name)
        self._remove_files(name)
        logger.info("namespace %s deleted: dropped, and its files on this host removed", name)

    def _remove_files(self, name: str, *, lifetime: bool = True) -> None:
        """The namespace's prior versions on this host (a namespace created again numbers its
        versions afresh) and, with ``lifetime``, its shared lifetime indexes (those of a log
        deleted and created again are never taken for the new one's, and may be in use)."""
        folders = []
        if self.persistence.prior_dir is not None:  # a prior's versions are folders in the namespace's
            folders.append(prior_files.folder_for(self.persistence.prior_dir, name, 0).parent)
        if self.shared is not None and lifetime:
            folders.append(lifetime_files.namespace_dir(self.shared.root, name))
        with self._prior_lock:  # not while a prior of the name is being saved there
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)

    def reload_priors(self) -> None:
        """Load every namespace's prior whose published version is not the one served."""
        try:
            self._discover()
        except StorageError as exc:
            logger.warning("namespace discovery deferred: %s", exc)
        with self._prior_lock:
            for name, drafter in self.service.namespaces.drafters().items():
                try:
                    version = self.persistence.prior_version(name)
                    if version is None or version == self.service.prior_version(name):
                        continue
                    if self._refused.get(name) != (drafter, version):  # a refused version is not read again
                        self._load_prior(name)
                except (StorageError, ValueError, OSError) as exc:  # a blob that does not parse, a folder not written
                    logger.warning("prior reload for %s deferred: %s", name, exc)

    def _load_prior(self, name: str) -> None:
        """Serve the namespace's published prior; one holding ids outside the namespace's
        vocabulary is refused (said once per version) and the prior served stays."""
        found = self.persistence.load_prior(name)
        if found is None:
            return
        prior, version = found
        drafter = self.service.namespace(name)
        try:
            self.service.set_prior(name, prior, version)
        except ValueError as exc:
            self._refused[name] = (drafter, version)
            logger.error(
                "namespace %s: static prior version %d refused (still serving version %d): %s",
                name, version, self.service.prior_version(name), exc,
            )  # fmt: skip
            return
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

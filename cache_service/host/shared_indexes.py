"""Lifetime indexes built once per host and mapped by every server process (``serve
--processes N``), instead of each process building and holding its own copy.

Each process follows the same lifetime log. A generation is built from the log itself, not from
any process's memory: the previous generation's tokens plus the log entries after the position it
covers, so every generation covers exactly the log up to a position. Whichever process holds the
namespace's build lock builds it; the others skip, and every process adopts the newest generation
(:meth:`LifetimeMemory.adopt <indexer.lifetime_index.LifetimeMemory.adopt>`), keeping in memory
only the requests past that position. If the builder dies, the lock is free for the next one.

The mapped arrays belong to the memory serving them, never to this registry: a namespace deleted
(its drafter dropped) lets go of its generation's files with its memory, so the space of the
files its deletion removed comes back (a registry that kept the arrays kept every deleted
namespace's last generation mapped, its disk space held, for as long as the process ran).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache_service.host import lifetime_files
from cache_service.host.lifetime_files import Generation
from cache_service.storage.redis_store import RedisStore
from cache_service.storage.stream_log import position, stream_id
from indexer.drafter import warm_draft_step
from indexer.lifetime_index import (
    LifetimeConfig,
    LifetimeIndexes,
    LifetimeMemory,
    LogId,
    appended_tokens,
    build_indexes,
    next_generation,
    next_indexes,
    search_arrays,
)
from indexer.tokens import SEPARATOR

logger = logging.getLogger(__name__)


def _warm_kernels(indexes: LifetimeIndexes, threads: int) -> None:
    """Mapped files are read-only arrays, a type of their own to the compiler: the kernels that
    run over them (drafting, on ``threads`` worker threads too; commits finding what the memory
    holds) compile now."""
    warm_draft_step(search_arrays(indexes), threads)
    indexes.suffix.match_range(np.zeros(1, dtype=np.int32))


def warm_mapped(config: LifetimeConfig, threads: int = 1) -> None:
    """Compile (or load) the kernels that run over mapped generations, before serving.
    Compiling holds the GIL for seconds (tens on a fresh machine): done when the first
    generation arrives, it would stall the event loop that long. A tiny generation is written
    and mapped back, so its arrays have exactly the mapped files' types."""
    tokens = np.array([5, 6, 5, 6, 7, SEPARATOR], dtype=np.int32)
    with tempfile.TemporaryDirectory(prefix="draftcache-warm-") as tmp:
        folder = lifetime_files.save(
            build_indexes(tokens, config.table, 0), log="warm", through=(0, 0), ns_dir=Path(tmp)
        )
        mapped = lifetime_files.load(folder).indexes
        _warm_kernels(mapped, threads)
        more = [np.array([6, 7], dtype=np.int32)]  # the next generation extends a mapped one
        next_indexes(mapped, next_generation(tokens, more, 16), appended_tokens(more, 16), config, 3)


@dataclass(frozen=True)
class _Adopted:
    """Which generation a namespace's memory serves: its folder and position, not its arrays."""

    memory: weakref.ReferenceType[LifetimeMemory]
    folder: Path
    through: LogId


class SharedIndexes:
    """One host's folder of published generations, for all namespaces."""

    def __init__(self, store: RedisStore, root: Path, config: LifetimeConfig) -> None:
        self.store = store
        self.root = root
        self.config = config
        self._adopted: dict[str, _Adopted] = {}
        self._identity: dict[str, str] = {}  # per namespace, the log's identity as last read
        self._lock = threading.Lock()

    def adopted(self, ns: str) -> LogId | None:
        """The log position the namespace's adopted generation covers up to (``None`` when the
        memory that adopted it is gone: the namespace was deleted)."""
        held = self._held(ns)
        return None if held is None else held.through

    def _held(self, ns: str, memory: LifetimeMemory | None = None) -> _Adopted | None:
        """What the namespace's memory (``memory``, when given) serves; an entry whose memory is
        gone, or is another one, counts as none."""
        held = self._adopted.get(ns)
        if held is None:
            return None
        alive = held.memory()
        if alive is None:
            self._adopted.pop(ns, None)
            self._identity.pop(ns, None)
            return None
        return held if memory is None or alive is memory else None

    def published(self, ns: str) -> Generation | None:
        """The namespace's current generation if it indexes this log; damaged or foreign
        files count as none."""
        try:
            gen = lifetime_files.current(lifetime_files.namespace_dir(self.root, ns))
        except ValueError as exc:
            logger.warning("ignoring lifetime files of %s: %s", ns, exc)
            return None
        if gen is not None and gen.log != self._identity.get(ns):
            self._identity[ns] = self.store.log_identity(ns)  # read again only when it differs
            if gen.log != self._identity[ns]:
                logger.info("ignoring lifetime files of %s: they index another log", ns)
                return None
        return gen

    def publish(self, ns: str, *, wait: bool = False, only_if_missing: bool = False) -> LifetimeIndexes | None:
        """Build and publish a generation covering the log's new entries, if this process gets
        the build lock (``wait``: wait for it) and there is anything new (``only_if_missing``:
        only when nothing valid is published yet). Returns what this process built."""
        ns_dir = lifetime_files.namespace_dir(self.root, ns)
        with lifetime_files.build_lock(ns_dir, wait=wait) as mine:
            if not mine:
                return None
            log = self._identity[ns] = self.store.log_identity(ns)  # read afresh before building
            previous = self.published(ns)
            if previous is not None and only_if_missing:
                return None
            start = time.perf_counter()
            after = "0" if previous is None else stream_id(previous.through)
            requests, last = self._read(ns, after)
            if previous is not None and not requests:
                return None
            through = position(last) if last is not None else (0, 0)
            last_gen = None if previous is None else previous.indexes
            capacity = self.config.capacity_tokens
            tokens = next_generation(None if last_gen is None else last_gen.suffix.tokens, requests, capacity)
            version = (0 if last_gen is None else last_gen.version) + int(sum(r.size + 1 for r in requests))
            built = next_indexes(last_gen, tokens, appended_tokens(requests, capacity), self.config, version)
            built = dataclasses.replace(built, build_seconds=time.perf_counter() - start)  # the log read too
            folder = lifetime_files.save(built, log=log, through=through, ns_dir=ns_dir)
            keep = {folder} | ({previous.folder} if previous is not None else set())
            lifetime_files.prune(ns_dir, keep)
            seconds = built.build_seconds
            how = "extended" if built.extended else "sorted afresh"
            logger.info(
                "published %s generation %s: %d tokens in %.2f s (%s)", ns, folder.name, tokens.size, seconds, how
            )
            return built

    def _read(self, ns: str, after: str) -> tuple[list[np.ndarray], str | None]:
        out: list[np.ndarray] = []
        last = None
        while True:
            entries = self.store.read_log(ns, after_id=after)
            if not entries:
                return out, last
            out.extend(np.asarray(e.tokens, dtype=np.int32) for e in entries)
            after = last = entries[-1].id

    def warm(self, threads: int = 1) -> None:
        """:func:`warm_mapped` for this host's lifetime configuration."""
        warm_mapped(self.config, threads)

    def adopt(self, ns: str, memory: LifetimeMemory, *, threads: int = 1) -> Generation | None:
        """Serve the namespace's newest published generation if it is not the one served;
        returns it when adopted (the draft step warmed for ``threads`` worker threads).
        Checking costs one small file read."""
        held = self._held(ns, memory)
        try:
            name = lifetime_files.current_name(lifetime_files.namespace_dir(self.root, ns))
        except ValueError:
            name = None  # damaged: published() below says why
        if held is not None and held.folder.name == name:
            return None
        gen = self.published(ns)
        with self._lock:
            held = self._held(ns, memory)
            if gen is None or (held is not None and held.folder == gen.folder):
                return None
            _warm_kernels(gen.indexes, threads)
            memory.adopt(gen.indexes, gen.through)
            self._adopted[ns] = _Adopted(weakref.ref(memory), gen.folder, gen.through)
        logger.info("%s serves lifetime generation %s (%d tokens)", ns, gen.folder.name, gen.indexes.suffix.size)
        return gen

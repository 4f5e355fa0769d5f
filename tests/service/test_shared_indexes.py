"""Lifetime indexes built once per host and memory-mapped by every process, on a real Redis."""

from __future__ import annotations

import fcntl
import gc
import inspect
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.config import EmbeddedRedisConfig
from cache_service.host import lifetime_files
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.host.shared_indexes import SharedIndexes
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from cache_service.storage.stream_log import position
from indexer import kernels
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.lifetime_index import LifetimeConfig, LifetimeMemory, build_indexes, next_generation
from indexer.tokens import Namespace
from tests.service.conftest import Replica, eventually


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path / "redis", appendonly=False)).start()
    yield server.url
    server.stop()


@pytest.fixture
def store(redis_url: str) -> RedisStore:
    s = RedisStore(connect(redis_url))
    s.register_namespace("toy", 100)
    return s


def _req(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def _folders(root: Path) -> list[str]:
    return sorted(p.name for p in lifetime_files.namespace_dir(root, "toy").iterdir() if p.name.startswith("g"))


def test_generations_follow_the_log_and_are_mapped_read_only(store: RedisStore, tmp_path: Path) -> None:
    config = LifetimeConfig(capacity_tokens=1000)
    shared = SharedIndexes(store, tmp_path / "lifetime", config)
    store.append_requests("toy", [_req(1, 2, 3), _req(4, 5)])
    built = shared.publish("toy")
    assert built is not None
    assert shared.publish("toy") is None  # nothing new in the log
    store.append_requests("toy", [_req(6, 7, 8)])
    assert shared.publish("toy") is not None
    gen = shared.published("toy")
    assert gen is not None
    every = [e.tokens for e in store.read_log("toy")]
    assert gen.indexes.suffix.tokens.tolist() == next_generation(None, every, 1000).tolist()
    assert gen.through == position(store.read_log("toy")[-1].id)
    tokens = gen.indexes.suffix.tokens
    assert isinstance(tokens.base, np.memmap) or isinstance(tokens, np.memmap)
    assert not tokens.flags.writeable
    assert len(_folders(tmp_path / "lifetime")) == 2  # the current generation and the one before

    memory = LifetimeMemory(config, ring=False)
    memory.commit(_req(6, 7, 8))  # a local commit the generation already covers, once placed
    memory.mark_logged(_req(6, 7, 8), gen.through)
    assert shared.adopt("toy", memory) is not None
    assert shared.adopt("toy", memory) is None  # already serving it
    assert memory.delta_tokens() == 0
    assert memory.indexes is not None and memory.indexes.suffix.size == gen.indexes.suffix.size


def test_a_generation_extends_the_mapped_one_unless_an_older_release_wrote_it(
    store: RedisStore, tmp_path: Path
) -> None:
    config = LifetimeConfig(capacity_tokens=12)
    root = tmp_path / "lifetime"
    shared = SharedIndexes(store, root, config)
    store.append_requests("toy", [_req(1, 2, 3), _req(4, 5)])
    first = shared.publish("toy")
    assert first is not None and not first.extended
    store.append_requests("toy", [_req(1, 2, 6, 7)])  # the head of the 12-token log falls out
    second = shared.publish("toy")
    assert second is not None and second.extended
    fresh = build_indexes(second.suffix.tokens, config.table, second.version)
    assert second.suffix.suffix_array.tolist() == fresh.suffix.suffix_array.tolist()
    gen = shared.published("toy")
    assert gen is not None and gen.indexes.extendable and gen.indexes.table_built_at == second.table_built_at
    # Files written before separators were ranked apart carry no format: sorted afresh next.
    meta_file = gen.folder / lifetime_files.META
    meta = json.loads(meta_file.read_text())
    del meta["format"], meta["table_version"]
    meta_file.write_text(json.dumps(meta))
    old = lifetime_files.load(gen.folder).indexes
    assert not old.extendable and old.table_built_at == old.version
    store.append_requests("toy", [_req(8, 9)])
    third = shared.publish("toy")
    assert third is not None and not third.extended


def test_damaged_or_foreign_files_are_ignored_and_replaced(store: RedisStore, tmp_path: Path) -> None:
    root = tmp_path / "lifetime"
    shared = SharedIndexes(store, root, LifetimeConfig(capacity_tokens=1000))
    store.append_requests("toy", [_req(1, 2, 3)])
    shared.publish("toy")
    gen = shared.published("toy")
    assert gen is not None
    (gen.folder / "sa.npy").write_bytes(b"not an array")
    assert shared.published("toy") is None
    assert shared.publish("toy", only_if_missing=True) is not None  # built again from the whole log
    again = shared.published("toy")
    assert again is not None and again.indexes.suffix.tokens.tolist()[:3] == [1, 2, 3]
    # A different log (the Redis was emptied and refilled) makes the files foreign.
    store.client.flushall()
    store.register_namespace("toy", 100)
    store.append_requests("toy", [_req(9, 9, 9)])
    restarted = SharedIndexes(store, root, LifetimeConfig(capacity_tokens=1000))
    assert restarted.published("toy") is None
    assert shared.publish("toy", only_if_missing=True) is not None  # the builder reads the identity afresh
    fresh = restarted.published("toy")
    assert fresh is not None and fresh.indexes.suffix.tokens.tolist()[:3] == [9, 9, 9]


def test_an_empty_file_in_a_generation_counts_as_none(store: RedisStore, tmp_path: Path) -> None:
    """What a power loss can leave of a generation written just before it: a file of no bytes."""
    shared = SharedIndexes(store, tmp_path / "lifetime", LifetimeConfig(capacity_tokens=1000))
    store.append_requests("toy", [_req(1, 2, 3)])
    shared.publish("toy")
    gen = shared.published("toy")
    assert gen is not None
    (gen.folder / "tokens.npy").write_bytes(b"")
    with pytest.raises(ValueError, match="not a saved generation"):
        lifetime_files.load(gen.folder)
    assert shared.published("toy") is None
    assert shared.publish("toy", only_if_missing=True) is not None  # built again from the whole log
    again = shared.published("toy")
    assert again is not None and again.indexes.suffix.tokens.tolist()[:3] == [1, 2, 3]


def test_a_file_damaged_in_place_counts_as_none(store: RedisStore, tmp_path: Path) -> None:
    """A generation's file overwritten in place (its size and header intact, its values not):
    suffix-array entries past the tokens' end crashed every process serving or extending it
    (SIGSEGV), and each restarted one again. It counts as none, and the next build sorts the
    whole log afresh instead of extending it."""
    shared = SharedIndexes(store, tmp_path / "lifetime", LifetimeConfig(capacity_tokens=1000))
    store.append_requests("toy", [_req(1, 2, 3), _req(4, 5)])
    shared.publish("toy")
    gen = shared.published("toy")
    assert gen is not None
    sa = np.load(gen.folder / "sa.npy", mmap_mode="r+")
    sa[:] = np.int32(1 << 30)  # far past the end of the tokens
    sa.flush()
    del sa
    with pytest.raises(ValueError, match="sa changed since written"):
        lifetime_files.load(gen.folder)
    assert shared.published("toy") is None
    store.append_requests("toy", [_req(6, 7)])
    built = shared.publish("toy")
    assert built is not None and not built.extended  # not built upon the damaged one
    again = shared.published("toy")
    assert again is not None and again.indexes.suffix.suffix_array.max() < again.indexes.suffix.size


def test_one_builder_at_a_time(store: RedisStore, tmp_path: Path) -> None:
    root = tmp_path / "lifetime"
    shared = SharedIndexes(store, root, LifetimeConfig(capacity_tokens=1000))
    store.append_requests("toy", [_req(1, 2, 3)])
    ns_dir = lifetime_files.namespace_dir(root, "toy")
    ns_dir.mkdir(parents=True)
    with open(ns_dir / lifetime_files.LOCK, "a+b") as held:  # another process is building
        fcntl.flock(held, fcntl.LOCK_EX)
        assert shared.publish("toy") is None
        assert shared.published("toy") is None
        timer = threading.Timer(0.3, lambda: fcntl.flock(held, fcntl.LOCK_UN))
        timer.start()
        began = time.monotonic()
        assert shared.publish("toy", wait=True) is not None  # an admin rebuild waits its turn
        assert time.monotonic() - began >= 0.25
        timer.join()
    store.append_requests("toy", [_req(4, 5, 6)])
    assert shared.publish("toy") is not None


class Worker(Replica):
    """One server process's App (in this process), sharing Redis and the lifetime folder."""

    def __init__(self, url: str, lifetime_dir: Path) -> None:
        super().__init__(url, lifetime_dir=lifetime_dir)

    def draft(self, prompt: list[int]) -> list[int]:
        sid = self.stub.OpenSessions(pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=prompt)]))
        item = pb.DraftItem(session_id=sid.session_ids[0])
        return list(self.stub.Draft(pb.DraftRequest(items=[item])).trees[0].tokens)

    def commit(self, prompt: list[int]) -> None:
        sid = self.stub.OpenSessions(pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=prompt)]))
        close = pb.CloseSession(session_id=sid.session_ids[0], commit=True)
        self.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[close]))


WAIT_S = 15.0  # for another process's build to be adopted


def test_workers_share_one_build_and_a_restarted_one_maps_it(redis_url: str, tmp_path: Path) -> None:
    root = tmp_path / "lifetime"
    a, b = Worker(redis_url, root), Worker(redis_url, root)
    try:
        a.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
        eventually(lambda: "toy" in b.app.service.namespace_names(), WAIT_S)
        a.commit([10, 11, 12, 13, 14])
        b.commit([20, 21, 22, 23, 24])
        # Each sees the other's request through the log, before any generation exists.
        eventually(lambda: a.draft([9, 20, 21])[:2] == [22, 23] and b.draft([9, 10, 11])[:2] == [12, 13], WAIT_S)
        a.admin.Rebuild(pb.RebuildRequest(namespace="toy"))
        built = a.app.shared
        assert built is not None and built.adopted("toy") is not None
        # b maps a's generation (no build of its own) and its delta empties.
        eventually(lambda: b.app.shared.adopted("toy") == built.adopted("toy"), WAIT_S)  # type: ignore[union-attr]
        assert len(_folders(root)) == 1
        mem_b = b.app.service.namespace("toy").memory
        assert mem_b.delta_tokens() == 0 and mem_b.buffer is None
        gen_tokens = mem_b.indexes.suffix.tokens  # type: ignore[union-attr]
        assert isinstance(gen_tokens.base, np.memmap) or isinstance(gen_tokens, np.memmap)
        assert b.draft([9, 10, 11])[:2] == [12, 13] and b.draft([9, 20, 21])[:2] == [22, 23]
        # A request after the generation lives in each delta until the next one.
        b.commit([30, 31, 32, 33])
        eventually(lambda: a.draft([9, 30, 31])[:2] == [32, 33], WAIT_S)
        assert mem_b.delta_tokens() == 5
        b.admin.Rebuild(pb.RebuildRequest(namespace="toy"))  # b builds this time
        eventually(lambda: a.app.service.namespace("toy").memory.delta_tokens() == 0, WAIT_S)
        assert len(_folders(root)) == 2
        stats = a.admin.Stats(pb.StatsRequest(namespace="toy")).namespaces[0]
        assert stats.index_tokens == mem_b.indexes.suffix.size  # type: ignore[union-attr]

        b.stop()
        b = Worker(redis_url, root)  # restarted: maps the published generation, builds nothing
        assert len(_folders(root)) == 2
        assert b.app.service.namespace("toy").memory.delta_tokens() == 0
        assert b.draft([9, 30, 31])[:2] == [32, 33] and b.draft([9, 10, 11])[:2] == [12, 13]
    finally:
        a.stop()
        b.stop()


def test_a_namespace_whose_generation_cannot_be_written_holds_up_no_other(
    store: RedisStore, redis_url: str, tmp_path: Path
) -> None:
    """A namespace whose folder cannot be written (a file stands where it goes; a full disk
    fails alike) is said in the log and tried again on the next run; the other namespaces'
    generations are built all the same, and a process starts and serves it from its log."""
    root = tmp_path / "lifetime"
    store.register_namespace("aa", 100)
    store.append_requests("aa", [_req(40, 41, 42, 43)])
    store.append_requests("toy", [_req(10, 11, 12, 13)])
    a = Worker(redis_url, root)
    b = None
    try:
        blocked = lifetime_files.namespace_dir(root, "aa")
        shutil.rmtree(blocked)
        blocked.write_text("in the way")
        store.append_requests("aa", [_req(50, 51, 52, 53)])
        store.append_requests("toy", [_req(20, 21, 22, 23)])
        eventually(lambda: a.app.service.namespace("toy").memory.delta_tokens() == 5, WAIT_S)  # followed
        a.app._rebuild()
        assert a.app.service.namespace("toy").memory.delta_tokens() == 0  # a generation of its own
        assert len(_folders(root)) == 2
        b = Worker(redis_url, root)  # starting: maps toy's generation, serves aa's log from memory
        assert b.app.shared is not None and b.app.shared.adopted("aa") is None
        assert b.app.service.namespace("aa").memory.delta_tokens() == 10
        assert b.app.service.namespace("toy").memory.delta_tokens() == 0 and b.draft([9, 20, 21])[:2] == [22, 23]
        blocked.unlink()
        b.app._rebuild()
        assert b.app.service.namespace("aa").memory.delta_tokens() == 0
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_deleted_namespace_lets_go_of_its_mapped_generation(redis_url: str, tmp_path: Path) -> None:
    """Deleting a namespace removes its generation's files; the process mapped them until it
    exited (their disk space held: a full buffer's generation is over 100 MB) because the
    registry of adopted generations kept the arrays of every namespace it ever served."""
    root = tmp_path / "lifetime"
    a = Worker(redis_url, root)
    try:
        a.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
        a.commit([10, 11, 12, 13, 14])
        a.admin.Rebuild(pb.RebuildRequest(namespace="toy"))
        folder = lifetime_files.namespace_dir(root, "toy")
        assert _mapped(folder)
        a.admin.DeleteNamespace(pb.DeleteNamespaceRequest(name="toy"))

        def let_go() -> bool:
            gc.collect()
            return not folder.exists() and not _mapped(folder)

        eventually(let_go, WAIT_S)
        assert a.app.shared is not None and a.app.shared.adopted("toy") is None
        # Created again, it maps a generation of its new log.
        a.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
        a.commit([20, 21, 22, 23])
        a.admin.Rebuild(pb.RebuildRequest(namespace="toy"))
        assert _mapped(folder) and a.draft([9, 20, 21])[:2] == [22, 23]
    finally:
        a.stop()


def _mapped(folder: Path) -> bool:
    """Whether this process maps a file under ``folder`` (removed or not)."""
    return f"{folder}/" in Path("/proc/self/maps").read_text()


def test_freed_heap_goes_back_to_the_os_after_a_build() -> None:
    import platform

    from cache_service.host.malloc import release_free_memory

    assert release_free_memory() == (platform.libc_ver()[0] == "glibc")


def _read_only_signatures(kernel: object) -> list:
    """Signatures compiled for read-only lifetime arrays (the prior's are read-only in all)."""
    main = list(inspect.signature(kernel.py_func).parameters).index("main_tokens")  # type: ignore[attr-defined]
    return [sig for sig in kernel.signatures if "readonly" in str(sig[main])]  # type: ignore[attr-defined]


@pytest.mark.slow  # compiles the threaded draft step for mapped arrays (tens of seconds when not cached)
def test_kernels_for_mapped_generations_compile_before_serving(store: RedisStore, tmp_path: Path) -> None:
    """Compiling holds the GIL: done when the first generation arrives while serving, it would
    stall the event loop. ``warm`` compiles them for arrays typed as the mapped files are."""
    shared = SharedIndexes(store, tmp_path / "lifetime", LifetimeConfig())
    shared.warm(threads=2)
    assert _read_only_signatures(kernels.draft_batch) and _read_only_signatures(kernels.draft_batch_parallel)
    compiled = len(_read_only_signatures(kernels.draft_batch_parallel))
    # A real generation, mapped, is drafted over without compiling for it again.
    store.append_requests("ns", [_req(1, 2, 3, 1, 2, 4), _req(2, 3, 5)])
    assert shared.publish("ns", wait=True) is not None
    drafter = NamespaceDrafter(Namespace(name="ns", vocab_size=10), DrafterConfig(threads=2), own_ring=False)
    assert shared.adopt("ns", drafter.memory, threads=drafter.threads) is not None
    session = drafter.open([1, 2])
    drafter.draft_many([(session, DraftParams()), (drafter.open([2, 3]), DraftParams())])
    assert drafter.threads == 1 or len(_read_only_signatures(kernels.draft_batch_parallel)) == compiled
    assert not list((tmp_path / "lifetime").glob("*warm*"))

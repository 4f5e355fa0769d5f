"""Priors saved as folders of arrays and memory-mapped: same lookups, atomic, shared; and a
published prior outside its namespace's vocabulary, never served."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.config import EmbeddedRedisConfig
from cache_service.host import lifetime_files, prior_files
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.persistence import RedisPersistence
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from indexer import kernels
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.lifetime_index import LifetimeConfig, build_indexes
from indexer.prior import PriorConfig, StaticPrior
from indexer.tokens import SEPARATOR, Namespace
from tests.faults import can_mount_tmpfs, fill_disk, small_disk
from tests.service.conftest import Replica


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path / "redis", appendonly=False)).start()
    yield server.url
    server.stop()


def _prior() -> StaticPrior:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 30, 3000).astype(np.int32)
    return StaticPrior.build(tokens, PriorConfig(orders=(1, 2, 3), follower_len=4))


def test_mapped_prior_answers_like_the_original(tmp_path: Path) -> None:
    prior = _prior()
    folder = prior_files.folder_for(tmp_path, "acme/llama 2", 3)
    assert folder.parent.name == "acme%2fllama%202" and folder.name == "v3"  # a safe name per namespace
    prior_files.save(prior, folder)
    mapped = prior_files.load(folder)
    assert isinstance(mapped.tables[0].arrays()["followers"], np.memmap)
    rng = np.random.default_rng(1)
    for _ in range(300):
        ctx = rng.integers(0, 30, 6).astype(np.int32)
        a, b = prior.lookup(ctx), mapped.lookup(ctx)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert (a.order, a.rows.tolist(), a.probs.tolist()) == (b.order, b.rows.tolist(), b.probs.tolist())
    assert mapped.source_tokens == prior.source_tokens and mapped.nbytes == prior.nbytes


def test_built_restored_and_mapped_priors_draft_the_same_trees_with_one_compiled_step(tmp_path: Path) -> None:
    """The draft step reads the prior's tables where they lie (mapped pages, not copies), and a
    prior of any origin, or none, is one type to it: swapping priors never compiles on a request."""
    prior = _prior()
    folder = tmp_path / "ns" / "v1"
    prior_files.save(prior, folder)
    variants = {
        "built": prior,
        "restored": StaticPrior.from_bytes(prior.to_bytes()),
        "mapped": prior_files.load(folder),
    }
    mapped_followers = variants["mapped"].tables[0].arrays()["followers"]
    assert np.shares_memory(variants["mapped"].kernel_args[4][0][1], mapped_followers)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 30, int(rng.integers(2, 40))).astype(np.int32) for _ in range(12)]
    trees = {}
    compiled = None
    for name, p in [*variants.items(), ("none", None)]:
        drafter = NamespaceDrafter(Namespace(name="ns", vocab_size=30), DrafterConfig(), p)
        sessions = [drafter.open(prompt) for prompt in prompts]
        got = drafter.draft_many([(s, DraftParams()) for s in sessions])
        trees[name] = [(t.tokens.tolist(), t.parents.tolist(), t.scores.tolist()) for t in got]
        if compiled is None:
            compiled = len(kernels.draft_batch.signatures)
        assert len(kernels.draft_batch.signatures) == compiled, name
    assert trees["built"] == trees["restored"] == trees["mapped"] != trees["none"]


def test_saving_is_all_or_nothing_and_a_second_save_is_a_no_op(tmp_path: Path) -> None:
    folder = tmp_path / "ns" / "v1"
    prior_files.save(_prior(), folder)
    before = sorted(p.name for p in folder.iterdir())
    prior_files.save(_prior(), folder)  # another process publishing the same version
    assert sorted(p.name for p in folder.iterdir()) == before
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_incomplete_or_foreign_folders_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "v1"
    prior_files.save(_prior(), folder)
    (folder / "t0_followers.npy").unlink()
    with pytest.raises(ValueError, match="not a saved prior"):
        prior_files.load(folder)
    other = tmp_path / "v2"
    prior_files.save(_prior(), other)
    np.save(other / "index_keys.npy", np.zeros(3, np.uint64))  # an index that disagrees
    with pytest.raises(ValueError, match="leader index"):
        prior_files.load(other)


def test_a_long_namespace_name_is_one_folder_name_of_bounded_length(tmp_path: Path) -> None:
    """Escaping triples a name's length, past the 255 bytes a file name may have: a name whose
    escaped form is too long keeps a prefix of it and gains a hash of the whole name, while a
    shorter one keeps the folder it always had."""
    longest, other = "a" + ":" * 127, "a" + ":" * 126 + "b"
    names = {prior_files.safe_name(longest), prior_files.safe_name(other)}
    assert len(names) == 2 and all(len(n.encode()) <= prior_files.MAX_NAME_BYTES for n in names)
    assert prior_files.safe_name("a" + ":" * 60) == "a" + "%3a" * 60  # fits: escaped as before
    folder = prior_files.folder_for(tmp_path / "priors", longest, 1)
    prior_files.save(_prior(), folder)
    assert prior_files.load(folder).source_tokens == 3000
    ns_dir = lifetime_files.namespace_dir(tmp_path / "lifetime", longest)
    tokens = np.array([5, 6, 7, SEPARATOR], dtype=np.int32)
    lifetime_files.save(build_indexes(tokens, LifetimeConfig().table, 1), log="log", through=(1, 0), ns_dir=ns_dir)
    gen = lifetime_files.current(ns_dir)
    assert gen is not None and gen.indexes.suffix.tokens.tolist() == tokens.tolist()


def test_versions_before_the_previous_one_and_dead_writers_temporaries_are_removed(
    redis_url: str, tmp_path: Path
) -> None:
    """A prior version's folder goes once two newer ones were mapped (the previous one stays: a
    process not yet moved on, or a rollback, may use it); a temporary folder goes once its
    writer must be dead."""
    store = RedisStore(connect(redis_url))
    persistence = RedisPersistence(store, max_pending=100, prior_dir=tmp_path / "priors")
    ns_dir = prior_files.folder_for(tmp_path / "priors", "toy", 0).parent
    dead, writing = ns_dir / ".v9.4000001.tmp", ns_dir / ".v9.4000002.tmp"
    versions = []
    for seed in (1, 2, 3):
        versions.append(store.put_prior("toy", _prior().to_bytes()))
        found = persistence.load_prior("toy")
        assert found is not None and found[1] == versions[-1]
        if seed == 1:
            dead.mkdir()
            writing.mkdir()
            old = time.time() - 2 * prior_files.STALE_TMP_S
            os.utime(dead, (old, old))
    assert sorted(p.name for p in ns_dir.iterdir()) == sorted([writing.name, *(f"v{v}" for v in versions[1:])])


def _cut_short(folder: Path) -> None:
    """What a power loss can leave of a file written just before it."""
    f = folder / "t0_followers.npy"
    os.truncate(f, f.stat().st_size - 8)


def test_a_damaged_prior_folder_is_saved_again_from_storage(redis_url: str, tmp_path: Path) -> None:
    """A folder that does not load is removed and written again from the stored blob (whose
    digest is checked): by a process starting, and by one serving."""
    store = RedisStore(connect(redis_url))
    priors = tmp_path / "priors"
    prior = StaticPrior.build(
        np.array([5, 6, 70, 71, 72, 73] * 20, np.int32), PriorConfig(orders=(1, 2), follower_len=4)
    )
    first = Replica(redis_url, prior_dir=priors)
    try:
        first.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
        version = store.put_prior("toy", prior.to_bytes())
        (info,) = first.admin.Rebuild(pb.RebuildRequest(namespace="toy")).namespaces
        assert info.prior_version == version
    finally:
        first.stop()
    folder = prior_files.folder_for(priors, "toy", version)
    _cut_short(folder)
    second = Replica(redis_url, prior_dir=priors)
    try:
        (info,) = second.admin.Stats(pb.StatsRequest(namespace="toy")).namespaces
        assert info.prior_version == version and {70, 71, 72, 73} <= set(_drafted(second, [1, 2, 5, 6]))
        _cut_short(folder)
        found = second.app.persistence.load_prior("toy")  # what the reload job does
        assert found is not None and found[1] == version
        assert prior_files.load(folder).source_tokens == found[0].source_tokens == 120
    finally:
        second.stop()


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs to mount a tmpfs (root)")
def test_a_save_that_fills_the_disk_leaves_nothing_and_a_retry_succeeds(tmp_path: Path) -> None:
    prior = _prior()
    with small_disk(tmp_path / "disk", "4m") as disk:
        folder = prior_files.folder_for(disk / "priors", "toy", 1)
        folder.parent.mkdir(parents=True)
        filler = fill_disk(disk)
        os.truncate(filler, filler.stat().st_size - prior.nbytes // 2)  # room for half of it
        with pytest.raises(OSError):
            prior_files.save(prior, folder)
        assert not list(folder.parent.iterdir())  # the partial copy went, and the space it held
        filler.unlink()
        prior_files.save(prior, folder)  # the same process, once there is room again
        assert prior_files.load(folder).source_tokens == prior.source_tokens
        assert [p.name for p in folder.parent.iterdir()] == ["v1"]


def test_a_prior_that_cannot_be_saved_holds_up_no_other_namespace(redis_url: str, tmp_path: Path) -> None:
    """A namespace whose prior folder cannot be written (a file stands where it goes; a full disk
    fails alike) is said in the log and tried again; the other namespaces' priors load, at
    start-up too, and the service starts."""
    store = RedisStore(connect(redis_url))
    priors = tmp_path / "priors"
    blocked = prior_files.folder_for(priors, "aa", 0).parent
    priors.mkdir()
    blocked.write_text("in the way")
    first = Replica(redis_url, prior_dir=priors)
    try:
        for name in ("aa", "zz"):
            first.admin.CreateNamespace(pb.CreateNamespaceRequest(name=name, vocab_size=100))
        versions = {name: store.put_prior(name, _prior().to_bytes()) for name in ("aa", "zz")}
        first.app.sync.reload_priors()
        assert first.app.service.prior_version("zz") == versions["zz"]
        assert first.app.service.prior_version("aa") == 0
    finally:
        first.stop()
    second = Replica(redis_url, prior_dir=priors)
    try:
        assert second.app.service.prior_version("zz") == versions["zz"]
        assert second.app.service.prior_version("aa") == 0
        blocked.unlink()
        second.app.sync.reload_priors()
        assert second.app.service.prior_version("aa") == versions["aa"]
    finally:
        second.stop()


def _drafted(r: Replica, prompt: list[int]) -> list[int]:
    opened = r.stub.OpenSessions(pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=prompt)]))
    (tree,) = r.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=opened.session_ids[0])])).trees
    return list(tree.tokens)


def test_a_published_prior_outside_the_namespace_vocabulary_is_never_served(tmp_path: Path) -> None:
    """A prior warmed with another tokenizer reaches storage: replicas refuse it and serve the
    prior they had (a replica starting then serves none), so drafts stay inside the vocabulary."""
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    store = RedisStore(connect(server.url))
    first = Replica(server.url)
    second = None
    try:
        first.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
        config = PriorConfig(orders=(1, 2), follower_len=4)
        good = StaticPrior.build(np.array([5, 6, 70, 71, 72, 73] * 20, np.int32), config)
        bad = StaticPrior.build(np.array([5, 6, 170, 171, 172, 173] * 20, np.int32), config)
        version = store.put_prior("toy", good.to_bytes())
        (info,) = first.admin.Rebuild(pb.RebuildRequest(namespace="toy")).namespaces
        assert info.prior_version == version
        assert {70, 71, 72, 73} <= set(_drafted(first, [1, 2, 5, 6]))  # the good prior drafts
        store.put_prior("toy", bad.to_bytes())
        (info,) = first.admin.Rebuild(pb.RebuildRequest(namespace="toy")).namespaces
        assert info.prior_version == version  # refused: the good one is still served
        drafted = _drafted(first, [1, 2, 5, 6])
        assert {70, 71, 72, 73} <= set(drafted) and max(drafted) < 100
        second = Replica(server.url)  # restoring from storage, where the bad prior is published
        (info,) = second.admin.Stats(pb.StatsRequest(namespace="toy")).namespaces
        assert info.prior_version == 0 and max(_drafted(second, [1, 2, 5, 6]), default=0) < 100
    finally:
        for r in (first, second):
            if r is not None:
                r.stop()
        server.stop()

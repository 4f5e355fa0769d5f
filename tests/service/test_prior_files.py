"""Priors saved as folders of arrays and memory-mapped: same lookups, atomic, shared; and a
published prior outside its namespace's vocabulary, never served."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.config import EmbeddedRedisConfig
from cache_service.host import prior_files
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from indexer import kernels
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.prior import PriorConfig, StaticPrior
from indexer.tokens import Namespace
from tests.service.conftest import Replica


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

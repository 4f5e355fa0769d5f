"""A caller's model vocabulary against its namespace's: opens and log and prior reads that state
another one (another tokenizer, whose ids mean other text there) are refused before anything is
opened or read. A real service on a real Redis."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.app import connect
from cache_service.config import EmbeddedRedisConfig
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.storage.redis_store import RedisStore
from indexer.prior import PriorConfig, StaticPrior
from tests.service.conftest import Replica

NS = "toy"
VOCAB = 100
OTHER = 64  # another tokenizer's: the ids used here lie in both, so only the sizes tell them apart
PROMPT = [5, 17, 23, 42, 8, 15, 1, 2, 5, 17]  # prompt lookup drafts "23 42 8" after "5 17"
ANSWER = list(range(40, 60))  # what the namespace's own fleet finished


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Replica, RedisStore]]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    r = Replica(server.url)
    r.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NS, vocab_size=VOCAB))
    yield r, RedisStore(connect(server.url))
    r.stop()
    server.stop()


def _calls(r: Replica, stated: int) -> dict[str, Callable[[], object]]:
    """An open, a log read and a prior read, each stating ``stated`` as the caller's vocabulary."""
    return {
        "open": lambda: r.stub.OpenSessions(
            pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=NS, prompt=PROMPT, vocab_size=stated)])
        ),
        "log": lambda: r.stub.ReadLog(pb.ReadLogRequest(namespace=NS, after="0", max_tokens=100, vocab_size=stated)),
        "prior": lambda: r.stub.ReadPrior(pb.ReadPriorRequest(namespace=NS, max_bytes=16, vocab_size=stated)),
    }


@pytest.mark.parametrize("stated", [0, VOCAB], ids=["not-stated", "the-namespaces"])
def test_calls_stating_no_vocabulary_or_the_namespaces_are_served(
    served: tuple[Replica, RedisStore], stated: int
) -> None:
    replica, store = served
    version = store.put_prior(NS, StaticPrior.build(np.array(ANSWER, np.int32), PriorConfig(orders=(1,))).to_bytes())
    calls = _calls(replica, stated)
    assert len(calls["open"]().session_ids) == 1  # type: ignore[attr-defined]
    assert calls["log"]().last == "0"  # type: ignore[attr-defined]  # an empty log, read from its start
    assert calls["prior"]().version == version  # type: ignore[attr-defined]


def test_calls_stating_another_vocabulary_are_refused_before_anything_is_done(
    served: tuple[Replica, RedisStore],
) -> None:
    replica, _ = served
    for name, call in _calls(replica, OTHER).items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION, name
        assert "vocab_size 100" in refused.value.details() and "model 64" in refused.value.details(), name
    # A batch with one such item opens none of its items.
    both = [pb.OpenSession(namespace=NS, prompt=PROMPT), pb.OpenSession(namespace=NS, prompt=PROMPT, vocab_size=OTHER)]
    with pytest.raises(grpc.RpcError) as refused:
        replica.stub.OpenSessions(pb.OpenSessionsRequest(sessions=both))
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert replica.admin.Stats(pb.StatsRequest(namespace=NS)).namespaces[0].sessions == 0

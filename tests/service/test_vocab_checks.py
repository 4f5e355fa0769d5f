"""A caller's model vocabulary against its namespace's: opens and log and prior reads that state
another one (another tokenizer, whose ids mean other text there) are refused before anything is
opened or read, and clients so refused draft locally and commit nothing into the namespace. A
real service on a real Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.app import connect
from cache_service.storage.redis_store import RedisStore
from decoder_client.client import AsyncDraftClient, ClientConfig
from decoder_client.client.near import NearClient
from indexer.drafter import DraftParams
from indexer.prior import PriorConfig, StaticPrior
from tests.service.conftest import Replica, ended_requests, eventually, replica_with_namespace

NS = "toy"
VOCAB = 100
OTHER = 64  # another tokenizer's: the ids used here lie in both, so only the sizes tell them apart
PROMPT = [5, 17, 23, 42, 8, 15, 1, 2, 5, 17]  # prompt lookup drafts "23 42 8" after "5 17"
ANSWER = list(range(40, 60))  # what the namespace's own fleet finished


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Replica, RedisStore]]:
    with replica_with_namespace(tmp_path, NS, VOCAB) as (r, url):
        yield r, RedisStore(connect(url))


def _calls(r: Replica, stated: int) -> dict[str, Callable[[], object]]:
    """An open, a log read and a prior read, each stating ``stated`` as the caller's vocabulary."""
    return {
        "open": lambda: r.stub.OpenSessions(
            pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=NS, prompt=PROMPT, vocab_size=stated)])
        ),
        "log": lambda: r.stub.ReadLog(pb.ReadLogRequest(namespace=NS, after="0", max_tokens=100, vocab_size=stated)),
        "prior": lambda: r.stub.ReadPrior(pb.ReadPriorRequest(namespace=NS, max_bytes=16, vocab_size=stated)),
    }


def _commit(r: Replica, tokens: list[int]) -> None:
    """One request of the namespace's fleet committed (by a client that states no vocabulary),
    and in the log."""
    (sid,) = r.stub.OpenSessions(
        pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=NS, prompt=tokens)])
    ).session_ids
    r.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)]))
    eventually(lambda: r.admin.Stats(pb.StatsRequest()).storage.journaled_commits == 0)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refuses namespace" in r.getMessage()]


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


def test_a_model_padding_the_namespaces_tokenizer_is_served_and_a_larger_gap_is_not(
    served: tuple[Replica, RedisStore],
) -> None:
    """A model's embedding table padded past its tokenizer (a multiple of 64, at most a 64th
    more) states a size the namespace (registered with the tokenizer's) takes for its own."""
    replica, _ = served
    replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name="padded", vocab_size=1010))
    for stated, served_here in ((1024, True), (1010, True), (1088, False), (1011, False)):
        request = pb.OpenSession(namespace="padded", prompt=PROMPT, vocab_size=stated)
        try:
            replica.stub.OpenSessions(pb.OpenSessionsRequest(sessions=[request]))
        except grpc.RpcError as exc:
            assert not served_here and exc.code() is grpc.StatusCode.FAILED_PRECONDITION, stated
        else:
            assert served_here, stated


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_client_of_another_vocabulary_drafts_locally_and_commits_nothing(
    served: tuple[Replica, RedisStore], stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Requests opened as an engine opens them (in the background, drafting meanwhile): the
    first open's refusal drops what was kept to commit, later requests are not kept at all, and
    the reason is logged once."""
    replica, store = served
    config = ClientConfig(target=replica.target, namespace=NS, vocab_size=OTHER, stream=stream, deadline_s=0.5)
    caplog.set_level(logging.INFO, logger="decoder_client")
    client, drafts = ended_requests(config, PROMPT, ANSWER, 5)
    assert all(d[:3] == [23, 42, 8] for d in drafts)
    assert store.read_log(NS) == []
    assert client.stats.remote == 0 and client.stats.fallback == 5
    assert client.stats.commits_dropped == 5
    (refusal,) = _refusals(caplog)
    assert "vocab_size 100" in refusal and "model 64" in refusal


def test_an_async_client_of_another_vocabulary_drafts_locally_and_commits_nothing(
    served: tuple[Replica, RedisStore], caplog: pytest.LogCaptureFixture
) -> None:
    replica, store = served
    config = ClientConfig(target=replica.target, namespace=NS, vocab_size=OTHER, deadline_s=0.5)
    caplog.set_level(logging.INFO, logger="decoder_client")

    async def scenario() -> AsyncDraftClient:
        client = AsyncDraftClient(config)
        try:
            for _ in range(3):
                (s,) = await client.open([PROMPT])
                assert (await client.draft([s], [[]]))[0].tokens.tolist()[:3] == [23, 42, 8]
                client.add_tokens([s], [ANSWER])
                await client.close([s])
            await client.settle()
        finally:
            await client.shutdown()
        return client

    client = asyncio.run(scenario())
    assert client.stats.remote == 0 and client.stats.fallback == 3
    assert client.stats.commits_dropped == 3 and client.stats.commits_pending == 0
    assert store.read_log(NS) == []
    assert len(_refusals(caplog)) == 1


def test_a_near_copy_of_another_vocabulary_neither_follows_the_namespace_nor_commits_to_it(
    served: tuple[Replica, RedisStore],
) -> None:
    replica, store = served
    store.put_prior(NS, StaticPrior.build(np.array(ANSWER * 4, np.int32), PriorConfig(orders=(1, 2))).to_bytes())
    _commit(replica, [1, 2, 3, *ANSWER])
    config = ClientConfig(target=replica.target, namespace=NS, params=DraftParams(chain=8))
    near = NearClient(config, OTHER, memory_tokens=1 << 16, follow_s=0.05, start_s=5.0, prior_check_s=0.05)
    later = NearClient(config, OTHER, memory_tokens=1 << 16, follow_s=0.05, start_s=0)  # follows from the log's end
    try:
        # Neither the log's history nor the prior was read; the one following from the end stops.
        assert near._follower is None and near.stats.followed == 0
        assert near.prior_follower is not None and near.prior_follower.loaded.is_set()
        assert near.stats.prior_version == 0 and near.drafter.prior is None
        eventually(lambda: later._follower is not None and not later._follower._thread.is_alive())
        # It drafts from what the request holds, never from the namespace's history.
        (s, t) = near.open([[7, 8, 1, 2, 3, 40, 41], PROMPT])
        chains = [tree.tokens.tolist() for tree in near.draft([s, t], [[], []])]
        assert chains[0][:2] != ANSWER[2:4] and chains[1][:3] == [23, 42, 8]
        near.add_tokens([s, t], [ANSWER[2:], [23, 42, 8]])
        near.close([s, t])
        near.settle()
        eventually(lambda: (near.settle(), near.stats.commits_pending == 0)[1])
    finally:
        near.shutdown()
        later.shutdown()
    assert near.stats.commits_dropped == 2
    assert [e.tokens.tolist() for e in store.read_log(NS)] == [[1, 2, 3, *ANSWER]]  # the fleet's only

"""The target's top-k written back with a draft call: checked at the boundary, fed to the
namespace's successor table, and drafted from as the successor tier, through real gRPC."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.client import ClientConfig, DraftClient, TopkAt
from indexer.tree_builder import Tier


def _ns(running, vocab: int = 128) -> None:  # type: ignore[no-untyped-def]
    request = pb.CreateNamespaceRequest(name="toy", vocab_size=vocab)
    pb_grpc.AdminStub(running.channel).CreateNamespace(request, wait_for_ready=True, timeout=10)


@pytest.mark.parametrize("columns", [True, False], ids=["columns", "items"])
def test_topk_rows_feed_the_successor_tier(running, columns: bool) -> None:  # type: ignore[no-untyped-def]
    _ns(running)
    client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0, topk=2))
    client._core.columns = columns
    (session,) = client.open([[10, 11, 12]])
    client.draft([session], [[]])
    # The step produced 13 then 14; where 13 was verified (after 12) the target's top-2 was
    # 13, 40; where 14 was (after 13), 14, 41.
    client.draft([session], [[13, 14]], topk=[[[13, 40], [14, 41]]])
    table = running.service.namespace("toy").successors
    assert table.followers_of(12) == [13, 40] and table.followers_of(13) == [14, 41]
    # Another request reaching 12 (never seen before it in its own context, nothing committed)
    # is drafted 13 then 14 from the successor tier.
    (other,) = client.open([[90, 12]])
    (tree,) = client.draft([other], [[]])
    roots = [i for i, p in enumerate(tree.parents.tolist()) if p == -1]
    by_token = {int(tree.tokens[i]): i for i in roots}
    assert 13 in by_token and tree.sources[by_token[13]] == Tier.SUCCESSOR
    assert [int(tree.tokens[i]) for i, p in enumerate(tree.parents.tolist()) if p == by_token[13]][:1] == [14]
    assert client.stats.fallback == 0
    client.close([session, other], commit=False)


@pytest.mark.parametrize("columns", [True, False], ids=["columns", "items"])
def test_rows_at_every_verified_node_feed_the_successor_tier(running, columns: bool) -> None:  # type: ignore[no-untyped-def]
    # A decoder that verified a tree sends the target's row at every node, each after the
    # node's token: 50 was a node the target rejected, and its row still teaches the table.
    _ns(running)
    client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0, topk=2))
    client._core.columns = columns
    quiet, (session,) = client.open([[20, 21]]), client.open([[10, 11, 12]])
    client.draft([*quiet, session], [[], []])
    verified = TopkAt([12, 13, 50], [[13, 40], [14, 41], [51, 52]])
    client.draft([*quiet, session], [[22], [13, 14]], topk=[None, verified])
    table = running.service.namespace("toy").successors
    assert (table.followers_of(12), table.followers_of(13), table.followers_of(50)) == ([13, 40], [14, 41], [51, 52])
    assert table.followers_of(21) == [] and client.stats.fallback == 0
    assert running.service.sessions.get(session.server_id).session.context.tokens.tolist() == [10, 11, 12, 13, 14]
    client.close([*quiet, session], commit=False)


def test_bad_topk_is_refused_and_changes_nothing(running) -> None:  # type: ignore[no-untyped-def]
    _ns(running)
    stub = pb_grpc.DraftCacheStub(running.channel)
    sid = stub.OpenSessions(
        pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[1, 2, 3])]), timeout=10
    ).session_ids[0]
    cases = {
        "ids outside the vocabulary": pb.DraftItem(session_id=sid, new_tokens=[4], topk=[4, 999], topk_k=2),
        "rows not matching the tokens": pb.DraftItem(session_id=sid, new_tokens=[4, 5], topk=[4, 7], topk_k=2),
        "k above 8": pb.DraftItem(session_id=sid, new_tokens=[4], topk=list(range(9)), topk_k=9),
        "ids without k": pb.DraftItem(session_id=sid, new_tokens=[4], topk=[4]),
        "a position outside the vocabulary": pb.DraftItem(
            session_id=sid, new_tokens=[4], topk=[4, 7, 5, 6], topk_k=2, topk_after=[3, 128]
        ),
        "rows not matching the positions": pb.DraftItem(
            session_id=sid, new_tokens=[4], topk=[4, 7], topk_k=2, topk_after=[3, 4]
        ),
        "positions without rows": pb.DraftItem(session_id=sid, new_tokens=[4], topk_after=[-5, 10**9]),
    }
    for why, item in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.Draft(pb.DraftRequest(items=[item]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
    bad_columns = {
        "an id below -1": pb.DraftColumns(
            session_ids=[sid], new_token_counts=[1], new_tokens=[4], topk=[4, -2], topk_k=2
        ),
        "row counts not adding up": pb.DraftColumns(
            session_ids=[sid], new_token_counts=[1], new_tokens=[4], topk=[4, 7], topk_k=2, topk_after=[3],
            topk_counts=[2],
        ),
        "positions without row counts": pb.DraftColumns(
            session_ids=[sid], new_token_counts=[1], new_tokens=[4], topk=[4, 7], topk_k=2, topk_after=[3]
        ),
        "positions and row counts without rows": pb.DraftColumns(
            session_ids=[sid], new_token_counts=[1], new_tokens=[4], topk_after=[-5, 10**9, 7], topk_counts=[99, 42]
        ),
        "row counts without rows": pb.DraftColumns(
            session_ids=[sid], new_token_counts=[1], new_tokens=[4], topk_counts=[1]
        ),
        "row counts without positions": pb.DraftColumns(
            session_ids=[sid], new_token_counts=[1], new_tokens=[4], topk=[4, 7], topk_k=2, topk_counts=[99, 42]
        ),
    }  # fmt: skip
    for why, columns in bad_columns.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.Draft(pb.DraftRequest(columns=columns), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
    too_many = pb.DraftItem(session_id=sid, new_tokens=[4], topk=[4] * 5000, topk_k=1, topk_after=[3] * 5000)
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(pb.DraftRequest(items=[too_many]), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Nothing was taken: no successor rows, and the session's context is still the prompt.
    assert running.service.namespace("toy").successors.size == 0
    good = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[4], topk=[4, 7], topk_k=2)]))
    assert len(good.trees) == 1
    assert running.service.namespace("toy").successors.followers_of(3) == [4, 7]
    assert np.array_equal(running.service.sessions.get(sid).session.context.tokens, [1, 2, 3, 4])

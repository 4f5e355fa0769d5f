"""The client's per-request state: a context that grows a few tokens per decode step."""

from __future__ import annotations

import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from decoder_client.client import ClientConfig, ClientSession, TopkAt, prompt_lookup_fallback
from decoder_client.client.core import ClientCore
from indexer.tree_builder import DraftTree


def test_a_session_grows_its_context_and_what_the_service_has_yet_to_hear() -> None:
    s = ClientSession(np.array([5, 6, 7], dtype=np.int32), 3)
    before = s.context
    s.extend([8, 9])
    s.extend(np.array([10], dtype=np.int64))
    s.extend([])
    assert s.context.dtype == np.int32 and s.context.tolist() == [5, 6, 7, 8, 9, 10]
    assert len(s) == 6 and s.tokens(4) == [9, 10] and s.prompt_len == 3
    assert s.pending == [8, 9, 10] and all(type(t) is int for t in s.pending)
    assert before.tolist() == [5, 6, 7]  # an array read earlier is not changed by later tokens


def test_ids_outside_int32_or_not_integers_are_refused_and_change_nothing() -> None:
    s = ClientSession([1, 2], 2)
    with pytest.raises(OverflowError):
        s.extend([3, 2**31])
    with pytest.raises(OverflowError):
        s.extend([-(2**31) - 1])
    with pytest.raises(TypeError):
        s.extend(np.array([3.0]))
    assert s.context.tolist() == [1, 2] and s.pending == []


def test_a_long_request_built_step_by_step_keeps_every_token() -> None:
    # 20,000 steps of 3 tokens (with whole-context copies, ~1.2 G token copies; the cost itself
    # is measured outside the tests).
    s = ClientSession(np.zeros(1000, dtype=np.int32), 1000)
    step = [1, 2, 3]
    for _ in range(20_000):
        s.extend(step)
        s.pending.clear()
    assert len(s) == 61_000 and s.context[-3:].tolist() == step


def test_trees_come_back_in_order_with_fallbacks_where_the_service_had_no_copy() -> None:
    core = ClientCore(ClientConfig(target="x", namespace="ns"), prompt_lookup_fallback)
    remote, local = ClientSession([1, 2, 3, 1, 2], 5), ClientSession([4, 5, 6, 4, 5], 5)
    remote.server_id = "a"
    resp = pb.DraftResponse(trees=[pb.Tree(tokens=[9], parents=[-1], sources=b"\x01", scores=[0.5])])
    trees = core.trees([local, remote], resp)
    assert trees[1].tokens.tolist() == [9]
    assert trees[0].tokens.tolist() == prompt_lookup_fallback(local.context, 64).tokens.tolist() == [6, 4, 5]
    assert core.stats.remote == 1 and core.stats.fallback == 1
    # Every sequence answered by the service: its trees, as sent.
    only = core.trees([remote], resp)
    assert [t.tokens.tolist() for t in only] == [[9]] and isinstance(only[0], DraftTree)


def test_topk_rows_are_kept_with_the_token_each_follows_until_sent() -> None:
    s = ClientSession([], 0)
    s.extend([4, 5], topk=[[4, 1], [5, 2]], k=2)  # the first row follows no token: dropped
    s.extend([6], topk=[[6, 3, 9]], k=2)  # cut to k
    s.extend([7])  # no rows
    s.extend([8], topk=TopkAt(np.array([7, 30, 31]), [[8], [1, 2], [3, 4]]), k=2)  # every verified node
    assert s.take_topk(2) == ([4, 5, 7, 30, 31], [5, 2, 6, 3, 8, -1, 1, 2, 3, 4])
    assert s.take_topk(2) is None  # sent once
    with pytest.raises(ValueError, match="2 top-k rows for 1 positions"):
        TopkAt([7], [[8], [9]])
    with pytest.raises(ValueError, match="2 top-k rows for 1 tokens"):
        s.extend([9], topk=[[9], [1]], k=2)
    with pytest.raises(OverflowError):
        s.extend([9], topk=TopkAt([2**31], [[1]]), k=2)
    assert s.tokens() == [4, 5, 6, 7, 8] and s.take_topk(2) is None  # refused steps changed nothing

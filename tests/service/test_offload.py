"""Large draft calls compute off the event loop: other calls are served meanwhile, and calls
naming a session being drafted for wait their turn."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.config import ServerConfig, ServiceConfig
from cache_service.errors import ResourceExhausted
from cache_service.service import DraftItem, DraftService, OpenItem, PendingDrafts
from tests.service.conftest import Running, start_service, stop_service

PROMPT = [5, 17, 23, 42, 8, 15, 16, 4, 99, 7, 31, 64, 2, 11, 13, 21, 5, 17, 23]
SLOW_S = 0.8


def _running(draft_threads: int) -> Running:
    server = ServerConfig(port=0, draft_threads=draft_threads, offload_min_batch=2)
    running = start_service(ServiceConfig(), server_config=server)
    admin = pb_grpc.AdminStub(running.channel)
    admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=128), wait_for_ready=True, timeout=10)
    return running


@pytest.fixture
def slow_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft of two sequences or more takes SLOW_S to compute (wherever it is computed)."""
    compute = PendingDrafts.compute

    def slow(self: PendingDrafts) -> None:
        if self.sequences >= 2:
            time.sleep(SLOW_S)
        compute(self)

    monkeypatch.setattr(PendingDrafts, "compute", slow)


def _open(stub: pb_grpc.DraftCacheStub, n: int) -> list[str]:
    req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=PROMPT) for _ in range(n)])
    return list(stub.OpenSessions(req, timeout=10).session_ids)


def _draft(stub: pb_grpc.DraftCacheStub, sids: list[str], token: int) -> pb.DraftResponse:
    items = [pb.DraftItem(session_id=sid, new_tokens=[token]) for sid in sids]
    return stub.Draft(pb.DraftRequest(items=items), timeout=30)


def _in_background(fn) -> threading.Thread:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=fn)
    t.start()
    time.sleep(0.2)  # the slow draft is being computed
    return t


@pytest.mark.parametrize("threads", [2, 0], ids=["offloaded", "on-loop"])
def test_other_sessions_are_served_while_a_large_draft_computes(slow_batches, threads: int) -> None:  # type: ignore[no-untyped-def]
    running = _running(threads)
    try:
        stub = pb_grpc.DraftCacheStub(running.channel)
        big, (other,) = _open(stub, 2), _open(stub, 1)
        answered: list[pb.DraftResponse] = []
        t = _in_background(lambda: answered.append(_draft(stub, big, 7)))
        began = time.perf_counter()
        assert len(_draft(stub, [other], 7).trees) == 1
        waited = time.perf_counter() - began
        t.join()
        assert len(answered[0].trees) == 2
        if threads:
            assert waited < SLOW_S / 2  # served while the large draft computed on its thread
        else:
            assert waited > SLOW_S / 2  # on the event loop, it held every other call
    finally:
        stop_service(running)


def test_calls_naming_a_session_being_drafted_wait_for_its_tree(slow_batches) -> None:  # type: ignore[no-untyped-def]
    running = _running(2)
    try:
        stub = pb_grpc.DraftCacheStub(running.channel)
        first, second = _open(stub, 2)
        done: list[float] = []
        t = _in_background(lambda: (_draft(stub, [first, second], 7), done.append(time.perf_counter())))
        _draft(stub, [first], 9)  # races the call above: it goes second
        after = time.perf_counter()
        stub.Feedback(pb.FeedbackRequest(items=[pb.FeedbackItem(session_id=second, accepted=[3])]), timeout=10)
        t.join()
        assert done and done[0] <= after
        context = running.service.sessions.get(first).session.context.tokens.tolist()
        assert context == [*PROMPT, 7, 9]
        assert running.service.sessions.get(second).session.context.tokens.tolist() == [*PROMPT, 7, 3]
        stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=first)]), timeout=10)
        assert not running.service.sessions.holds(first)
    finally:
        stop_service(running)


def test_a_refused_offloaded_call_leaves_its_sessions_free(slow_batches) -> None:  # type: ignore[no-untyped-def]
    running = _running(2)
    try:
        stub = pb_grpc.DraftCacheStub(running.channel)
        first, second = _open(stub, 2)
        with pytest.raises(grpc.RpcError) as err:
            _draft(stub, [first, second], 500)  # outside the vocabulary: refused before drafting
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(_draft(stub, [first, second], 7).trees) == 2  # nothing was left waiting
        assert not running.service._in_flight
    finally:
        stop_service(running)


def test_sessions_being_drafted_for_stay_in_memory() -> None:
    prompt = np.arange(1, 41, dtype=np.int32)
    service = DraftService(ServiceConfig(max_session_tokens=60))
    service.create_namespace("toy", 128)
    (first,) = service.open([OpenItem("toy", prompt)])
    pending = service.begin_drafts([DraftItem(first, np.array([3], dtype=np.int32))])
    with pytest.raises(ResourceExhausted):  # the only session that could leave is being drafted for
        service.open([OpenItem("toy", prompt)])
    pending.compute()
    ((tree, _),) = service.finish_drafts(pending)
    service.release(pending)
    (second,) = service.open([OpenItem("toy", prompt)])  # now the first one leaves memory
    assert service.sessions.holds(second) and not service.sessions.holds(first)
    assert len(tree) > 0

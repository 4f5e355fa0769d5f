"""Long prompts are indexed on a worker thread: the calls of every other decoder go on meanwhile,
and what other calls changed while the index was built is looked at again before the session is
held."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.config import ServiceConfig
from cache_service.domain.errors import ResourceExhausted
from cache_service.domain.items import Opening, OpenItem
from cache_service.domain.service import DraftService
from cache_service.rpc.servicer import OFF_LOOP_TOKENS
from indexer import kernels
from indexer.session import Session
from tests.service.conftest import Running, start_service, stop_service

SID = "0ff100p0ff100p0ff100p0ff"
LONG = [int(t) for t in np.random.default_rng(7).integers(0, 50, OFF_LOOP_TOKENS)]


def _request(prompt: list[int], sid: str = "") -> pb.OpenSessionsRequest:
    return pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=prompt, session_id=sid)])


class _Held:
    """``build_sessions`` of the running service made to wait until released, and which
    thread it ran on."""

    def __init__(self, running: Running) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []
        build = running.service.build_sessions

        def held(opening: Opening) -> list[Session | None]:
            self.threads.append(threading.current_thread())
            if opening.prompt_tokens >= OFF_LOOP_TOKENS:
                self.started.set()
                assert self.release.wait(10)
            return build(opening)

        running.service.build_sessions = held  # type: ignore[method-assign]


def test_other_calls_are_answered_while_a_long_prompt_is_indexed(running: Running) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
    held = _Held(running)
    (short,) = running.stub.OpenSessions(_request([1, 2, 3, 1, 2])).session_ids
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(running.stub.OpenSessions, _request(LONG))
        assert held.started.wait(10)
        # The serving thread is free: a draft is answered before the long open is.
        tree = running.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=short, new_tokens=[3])])).trees[0]
        assert list(tree.tokens[:2]) == [1, 2]  # "2 3" was followed by "1 2"
        assert not opening.done()
        held.release.set()
        (sid,) = opening.result(10).session_ids
    serving, worker = held.threads  # the short prompt was built at once, on the serving thread
    assert worker is not serving
    session = running.service.sessions.get(sid).session
    assert session.context.tokens.tolist() == LONG and session.context.indexed == len(LONG) - 1
    # The session drafts from its indexed prompt: its opening tokens come back after a repeat.
    tree = running.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=LONG[:12])])).trees[0]
    path = kernels.accepted_path(
        np.array(tree.tokens, dtype=np.int32), np.array(tree.parents, dtype=np.int32), np.array(LONG[12:20], np.int32)
    )
    assert path.size >= 4


def test_an_id_opened_meanwhile_is_answered_not_doubled(running: Running) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
    held = _Held(running)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(running.stub.OpenSessions, _request(LONG, SID))
        assert held.started.wait(10)
        # A retry of the same open (a short prompt here, built at once) is held first.
        assert running.stub.OpenSessions(_request([1, 2, 3], SID)).session_ids == [SID]
        held.release.set()
        assert first.result(10).session_ids == [SID]
    assert len(running.service.sessions) == 1
    assert running.service.sessions.get(SID).session.context.tokens.tolist() == [1, 2, 3]


def test_the_session_memory_limit_is_kept_when_others_opened_meanwhile() -> None:
    limit = OFF_LOOP_TOKENS + 500
    running = start_service(ServiceConfig(max_session_tokens=limit))
    try:
        running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
        held = _Held(running)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(running.stub.OpenSessions, _request(LONG))
            assert held.started.wait(10)
            # Another open takes the room the first one was checked against.
            (other,) = running.stub.OpenSessions(_request([1] * 600)).session_ids
            held.release.set()
            (sid,) = first.result(10).session_ids
        # Checked again before it was held: without storage, the idle session made room.
        table = running.service.sessions
        assert table.tokens <= limit and table.holds(sid) and not table.holds(other)
    finally:
        stop_service(running)


def test_the_session_count_limit_is_kept_when_others_opened_meanwhile() -> None:
    running = start_service(ServiceConfig(max_sessions=2))
    try:
        running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
        held = _Held(running)
        two = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=p) for p in (LONG, [1, 2])])
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(running.stub.OpenSessions, two)
            assert held.started.wait(10)
            # Another open takes one of the two places the first one was checked against.
            (other,) = running.stub.OpenSessions(_request([1, 2, 3])).session_ids
            held.release.set()
            with pytest.raises(grpc.RpcError) as err:
                first.result(10)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        # Refused whole: neither of its sessions is held, the other open's is.
        assert len(running.service.sessions) == 1 and running.service.sessions.holds(other)
    finally:
        stop_service(running)


def test_a_batch_that_fails_while_held_leaves_nothing_behind() -> None:
    service = DraftService(ServiceConfig(max_sessions=2))
    service.create_namespace("toy", 50)
    opening = service.prepare_open([OpenItem("toy", [1, 2]), OpenItem("toy", [3, 4])])
    (other,) = service.open([OpenItem("toy", [5])])  # between the check and the hold
    # The second session finds no place when it is held: the first one, held already, goes too.
    with pytest.raises(ResourceExhausted):
        service.finish_open(opening)
    assert len(service.sessions) == 1 and service.sessions.holds(other)
    assert len(service.changes) == 1  # only the other open's session waits for storage

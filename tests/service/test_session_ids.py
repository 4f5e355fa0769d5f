"""Client-chosen session ids: a repeated open is answered with the same session, and a client
can close a copy whose open it gave up on."""

from __future__ import annotations

import time

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from decoder_client.client import ClientConfig, DraftClient
from tests.service.conftest import Running

SID = "c0ffee00c0ffee00c0ffee00"


def _open(running: Running, sid: str, namespace: str = "toy", prompt: tuple[int, ...] = (1, 2, 3)) -> str:
    req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=namespace, prompt=list(prompt), session_id=sid)])
    return str(running.stub.OpenSessions(req).session_ids[0])


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()  # type: ignore[no-any-return]


def test_a_repeated_open_returns_the_same_session(running: Running) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="other", vocab_size=50))
    assert _open(running, SID) == SID
    item = pb.DraftItem(session_id=SID, new_tokens=[4])
    running.stub.Draft(pb.DraftRequest(items=[item]))
    assert _open(running, SID) == SID  # a retry: the session and its context are kept
    assert len(running.service.sessions) == 1
    assert running.service.sessions.get(SID).session.context.tokens.tolist() == [1, 2, 3, 4]
    assert _code(lambda: _open(running, SID, namespace="other")) is grpc.StatusCode.ALREADY_EXISTS
    assert _code(lambda: _open(running, "short")) is grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: _open(running, "x{" + SID)) is grpc.StatusCode.INVALID_ARGUMENT
    twice = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[1], session_id="d" * 20)] * 2)
    assert _code(lambda: running.stub.OpenSessions(twice)) is grpc.StatusCode.INVALID_ARGUMENT
    assert len(running.service.sessions) == 1  # nothing was opened by the refused calls


def test_closing_with_missing_ok_skips_unknown_sessions(running: Running) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
    _open(running, SID)
    unknown = pb.CloseSession(session_id="e" * 32, commit=False)
    known = pb.CloseSession(session_id=SID, commit=False)
    strict = pb.CloseSessionsRequest(sessions=[unknown, known])
    assert _code(lambda: running.stub.CloseSessions(strict)) is grpc.StatusCode.NOT_FOUND
    assert len(running.service.sessions) == 1  # the refused call closed nothing
    unknown.missing_ok = True
    running.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[unknown, known]))
    assert len(running.service.sessions) == 0


def test_an_open_given_up_on_is_closed_when_the_service_answers(running: Running) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
    open_sessions = running.service.finish_open
    slow = {"on": True}

    def delayed(*args, **kwargs):  # type: ignore[no-untyped-def]
        if slow["on"]:
            time.sleep(0.3)  # past the client's open timeout: the client gives up, the server opens
        return open_sessions(*args, **kwargs)

    running.service.finish_open = delayed  # type: ignore[method-assign]
    client = DraftClient(ClientConfig(target=running.target, namespace="toy", control_timeout_s=0.1, retry_after_s=0))
    (session,) = client.open([[1, 2, 3, 1, 2]])
    assert client.stats.lost_opens == 1 and not session.server_id
    time.sleep(0.4)  # the server finished the open the client gave up on
    assert len(running.service.sessions) == 1
    slow["on"] = False
    (other,) = client.open([[5, 6, 7]])  # the service answers again: the lost copy is closed
    client.shutdown()
    assert other.server_id and len(running.service.sessions) == 1
    assert running.service.sessions.get(other.server_id) is not None

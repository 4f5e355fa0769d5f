"""Sessions belong to their tenant wherever they are held: in another replica's memory, only in
storage (after a restart, or opened elsewhere). Another tenant naming such a session gets what
an unknown id gets, and the session stays as it was."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from tests.service.authed_replicas import AuthReplica, md, start_redis
from tests.service.conftest import eventually
from tests.storage.servers import RedisServer

SID = "victim-session-0123456789"  # chosen by tenant a's client
UNKNOWN = "nobody-session-0123456789"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "redis-server")
    yield server
    server.stop()


def _refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _attempts(r: AuthReplica, sid: str) -> dict[str, Callable[[], object]]:
    """Every call tenant b could make naming ``sid`` in the namespace it shares with a."""
    b = md("tok-b")
    return {
        "open": lambda: r.stub.OpenSessions(
            pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="shared", prompt=[9, 9], session_id=sid)]),
            metadata=b,
        ),
        "draft": lambda: r.stub.Draft(
            pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[9])]), metadata=b
        ),
        "feedback": lambda: r.stub.Feedback(
            pb.FeedbackRequest(items=[pb.FeedbackItem(session_id=sid, accepted=[9])]), metadata=b
        ),
        "close": lambda: r.stub.CloseSessions(
            pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)]), metadata=b
        ),
    }


@pytest.mark.parametrize("elsewhere", ["other replica", "restart"])
def test_a_session_only_in_storage_cannot_be_taken_over_by_another_tenant(
    redis_server: RedisServer, tmp_path: Path, elsewhere: str
) -> None:
    replicas = [AuthReplica(redis_server.url, tmp_path / "first")]
    try:
        first = replicas[0]
        first.admin.CreateNamespace(pb.CreateNamespaceRequest(name="shared", vocab_size=100), metadata=md("tok-ops"))
        opened = pb.OpenSessionsRequest(
            sessions=[pb.OpenSession(namespace="shared", prompt=[1, 2, 3, 4, 1, 2], session_id=SID)]
        )
        first.stub.OpenSessions(opened, metadata=md("tok-a"))
        first.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=SID, new_tokens=[3])]), metadata=md("tok-a"))
        store = RedisStore(connect(redis_server.url))  # its own: a stopped replica's calls are cut
        eventually(lambda: (s := store.load_session(SID)) is not None and s.context.size == 7)
        if elsewhere == "restart":
            replicas.pop().stop()
        other = AuthReplica(redis_server.url, tmp_path / "other")
        replicas.append(other)
        eventually(lambda: "shared" in other.namespaces())
        before = store.load_session(SID)
        assert before is not None

        # Tenant b (which may use the namespace) gets, for every call, what an unknown id gets.
        for name, call in _attempts(other, SID).items():
            code, details = _refused(call)
            assert (code, details) == (grpc.StatusCode.NOT_FOUND, f"unknown or expired session {SID!r}"), name
        for name in ("draft", "feedback", "close"):
            code, details = _refused(_attempts(other, UNKNOWN)[name])
            assert (code, details) == (grpc.StatusCode.NOT_FOUND, f"unknown or expired session {UNKNOWN!r}"), name

        # The stored session is untouched, and its tenant continues it there, context and all.
        time.sleep(0.3)  # six write-behind rounds: anything the calls changed would be stored by now
        after = store.load_session(SID)
        assert after is not None and (after.tenant, after.namespace) == ("a", "shared")
        assert after.context.tolist() == before.context.tolist() == [1, 2, 3, 4, 1, 2, 3]
        tree = other.stub.Draft(
            pb.DraftRequest(items=[pb.DraftItem(session_id=SID, new_tokens=[4])]), metadata=md("tok-a")
        ).trees[0]
        assert list(tree.tokens[:2]) == [1, 2]
    finally:
        for r in replicas:
            r.stop()

"""Deleting a namespace, end to end: two replicas on one real Redis, the admin CLI, tenants."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service import cli
from cache_service.storage import keys
from cache_service.storage.redis_store import RedisStore
from tests.service.authed_replicas import AuthReplica, md, start_redis
from tests.service.conftest import eventually
from tests.storage.servers import RedisServer


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[AuthReplica, AuthReplica, RedisServer]]:
    server = start_redis(tmp_path / "redis-server")
    one = AuthReplica(server.url, tmp_path / "one")
    two = AuthReplica(server.url, tmp_path / "two")
    yield one, two, server
    one.stop()
    two.stop()
    server.stop()


def _open(r: AuthReplica, token: str, ns: str, prompt: list[int]) -> str:
    req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=ns, prompt=prompt)])
    return str(r.stub.OpenSessions(req, metadata=md(token)).session_ids[0])


def _close(r: AuthReplica, token: str, sid: str) -> None:
    r.stub.CloseSessions(
        pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)]), metadata=md(token)
    )


def _draft_code(r: AuthReplica, token: str, sid: str) -> grpc.StatusCode:
    try:
        r.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid)]), metadata=md(token))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _cli(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(list(argv)) == 0
    return out.getvalue()


def _stored_namespaces(store: RedisStore) -> set[str]:
    return {s.namespace for sid in store.session_ids() if (s := store.load_session(sid)) is not None}


def test_a_deleted_namespace_is_gone_from_storage_and_every_replica(
    replicas: tuple[AuthReplica, AuthReplica, RedisServer],
) -> None:
    one, two, server = replicas
    for ns in ("ns-a", "ns-b"):
        one.admin.CreateNamespace(pb.CreateNamespaceRequest(name=ns, vocab_size=100), metadata=md("tok-ops"))
    eventually(lambda: {"ns-a", "ns-b"} <= two.namespaces())
    _close(one, "tok-a", _open(one, "tok-a", "ns-a", [1, 2, 3, 4]))  # committed: ns-a's log has it
    _close(one, "tok-b", _open(one, "tok-b", "ns-b", [5, 6, 7, 8]))
    doomed = [
        _open(one, "tok-a", "ns-a", [1, 2]),
        _open(one, "tok-a", "ns-a", [3, 4]),
        _open(two, "tok-a", "ns-a", [5]),
    ]
    kept = _open(one, "tok-b", "ns-b", [5, 6])
    store = one.app.persistence.store
    eventually(lambda: len(store.session_ids()) == 4)
    leftover = two.app.persistence.prior_dir / "ns-a" / "v1"  # type: ignore[operator]
    leftover.mkdir(parents=True)  # a prior of ns-a mapped on the second replica's host
    assert set(server.client().scan_iter(match=keys.namespace_pattern("ns-a")))

    # Only an admin whose token covers the namespace may delete it.
    for token in ("tok-a", "tok-b"):
        with pytest.raises(grpc.RpcError) as err:
            one.admin.DeleteNamespace(pb.DeleteNamespaceRequest(name="ns-a"), metadata=md(token))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        one.admin.DeleteNamespace(pb.DeleteNamespaceRequest(name="ns-b"), metadata=md("tok-a-admin"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    said = _cli("namespaces", "delete", "ns-a", "--target", one.target, "--token", "tok-a-admin")
    assert said == "namespace ns-a deleted; 2 live sessions ended\n"

    # Storage keeps nothing of it: no key (SCAN), no registration, no stored session.
    assert set(server.client().scan_iter(match=keys.namespace_pattern("ns-a"))) == set()
    assert "ns-a" not in store.namespaces()
    assert _draft_code(one, "tok-a", doomed[0]) == grpc.StatusCode.NOT_FOUND
    # The other replica drops it when its sync notices: its session ends, its files go.
    eventually(lambda: "ns-a" not in two.namespaces())
    eventually(lambda: _draft_code(two, "tok-a", doomed[2]) == grpc.StatusCode.NOT_FOUND)
    eventually(lambda: not leftover.parent.exists())
    eventually(lambda: _stored_namespaces(store) == {"ns-b"})
    assert set(server.client().scan_iter(match=keys.namespace_pattern("ns-a"))) == set()

    # Nothing else changed: the other namespace, its session, its log.
    assert _draft_code(two, "tok-b", kept) == grpc.StatusCode.OK
    assert store.log_size("ns-b") == (1, 4) and store.namespaces() == {"ns-b": 100}
    # The name can be used again, afresh, and every replica learns the new one.
    two.admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns-a", vocab_size=50), metadata=md("tok-a-admin"))
    eventually(lambda: "ns-a" in one.namespaces())
    listed = _cli("namespaces", "list", "--target", one.target, "--token", "tok-ops")
    assert listed.splitlines() == ["ns-a  vocab 50  0 sessions  prior v0", "ns-b  vocab 100  1 sessions  prior v0"]
    assert store.log_size("ns-a") == (0, 0)


def test_deleting_an_unknown_namespace_is_not_found(replicas: tuple[AuthReplica, AuthReplica, RedisServer]) -> None:
    one, _, _ = replicas
    with pytest.raises(grpc.RpcError) as err:
        one.admin.DeleteNamespace(pb.DeleteNamespaceRequest(name="never-was"), metadata=md("tok-ops"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

"""Deleting a namespace, end to end: two replicas on one real Redis, the admin CLI, tenants."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service import cli
from cache_service.config import ServiceConfig
from cache_service.domain.service import DraftService
from cache_service.persistence import RedisPersistence
from cache_service.storage import keys
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from cache_service.sync import StorageSync
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


# -- the storage sync against a registry read older than what happened here -----------------


class _ReadThen(RedisPersistence):
    """A persistence whose next registry read is followed, before it returns, by ``then``:
    what another thread of the replica did while the read was on its way."""

    then: Callable[[], object] | None = None

    def namespaces(self) -> dict[str, int]:
        found = super().namespaces()
        then, self.then = self.then, None
        if then is not None:
            then()
        return found


@pytest.fixture
def synced(tmp_path: Path) -> Iterator[tuple[DraftService, StorageSync, _ReadThen, RedisStore]]:
    """A service and its storage sync on a real Redis, with namespace ``ns`` (vocab 10)
    registered and restored; the sync is driven by the test, never on a schedule."""
    server = start_redis(tmp_path / "redis-server")
    store = RedisStore(connect(server.url))
    store.register_namespace("ns", 10)
    persistence = _ReadThen(store, max_pending=10, prior_dir=tmp_path / "priors")
    service = DraftService(ServiceConfig(), persistence)
    sync = StorageSync(service, persistence, None)
    sync.restore()
    yield service, sync, persistence, store
    server.stop()


def test_a_namespace_created_again_here_outlives_a_registry_read_that_missed_it(
    synced: tuple[DraftService, StorageSync, _ReadThen, RedisStore],
) -> None:
    service, sync, persistence, store = synced
    service.delete_namespace("ns")
    # The sync reads the registry between the deletion and the creation that follows it.
    persistence.then = lambda: service.create_namespace("ns", 10)
    sync.sync()
    created = service.namespace("ns")  # not forgotten for a read older than it
    sync.sync()
    assert service.namespace("ns") is created and store.namespaces() == {"ns": 10}


def test_a_namespace_whose_registration_is_under_way_outlives_a_read_that_missed_it(
    synced: tuple[DraftService, StorageSync, _ReadThen, RedisStore],
) -> None:
    service, sync, persistence, store = synced
    service.delete_namespace("ns")
    # Created in memory, registered in storage only once the sync's read has gone by.
    created, _ = service.namespaces.create("ns", 10)
    persistence.then = lambda: persistence.namespace_created("ns", 10)
    sync.sync()
    sync.sync()
    assert service.namespace("ns") is created and store.namespaces() == {"ns": 10}


def test_a_prior_folder_of_a_namespace_deleted_and_created_again_here_goes(
    synced: tuple[DraftService, StorageSync, _ReadThen, RedisStore], tmp_path: Path
) -> None:
    service, sync, _, _ = synced
    old_prior = tmp_path / "priors" / "ns" / "v1"
    old_prior.mkdir(parents=True)  # the deleted namespace's version 1; the new one's starts again
    service.delete_namespace("ns")
    service.create_namespace("ns", 10)  # before any sync read saw the deletion
    sync.sync()
    assert not old_prior.exists() and service.namespace_names() == ["ns"]


def test_a_namespace_deleted_elsewhere_is_forgotten_and_one_created_again_takes_its_new_vocabulary(
    synced: tuple[DraftService, StorageSync, _ReadThen, RedisStore],
) -> None:
    service, sync, _, store = synced
    store.delete_namespace("ns")  # by another replica
    sync.sync()
    assert service.namespace_names() == []
    service.create_namespace("ns", 10)
    sync.sync()  # the registry holds it: the sync saw this one
    store.delete_namespace("ns")  # another replica deletes it and creates it with another vocabulary,
    store.register_namespace("ns", 20)  # both between two reads of this one
    sync.sync()
    assert service.namespace("ns").namespace.vocab_size == 20


def test_a_namespace_created_here_and_deleted_elsewhere_before_any_read_goes_after_a_grace(
    synced: tuple[DraftService, StorageSync, _ReadThen, RedisStore],
) -> None:
    service, sync, _, store = synced
    service.create_namespace("other", 10)
    store.delete_namespace("other")  # by another replica, before this one's sync read it
    sync.registration_grace_s = 3600.0
    sync.sync()
    sync.sync()
    assert service.namespace_names() == ["ns", "other"]  # its registration might be under way
    sync.registration_grace_s = 0.0
    sync.sync()
    assert service.namespace_names() == ["ns"]


def test_a_namespace_deleted_and_created_again_elsewhere_with_the_same_vocabulary_is_replaced(
    synced: tuple[DraftService, StorageSync, _ReadThen, RedisStore],
) -> None:
    """Between two reads of this replica, another deletes the namespace and creates it again
    with the same vocabulary: its log is another, so the drafter made from the old one (the
    deleted namespace's history) goes, and a new one serves the name."""
    service, sync, _, store = synced
    old = service.namespace("ns")
    store.log_identity("ns")  # the log's identity, made by its first commit
    sync.sync()
    sync.sync()
    assert service.namespace("ns") is old  # the same log: nothing changes
    for made in (True, False):  # the new log with its identity made already, or not yet
        before = service.namespace("ns")
        store.delete_namespace("ns")
        store.register_namespace("ns", 10)
        if made:
            store.log_identity("ns")
        sync.sync()
        assert service.namespace("ns") is not before and service.namespace("ns").namespace.vocab_size == 10
        store.log_identity("ns")
        sync.sync()
        kept = service.namespace("ns")
        sync.sync()
        assert service.namespace("ns") is kept

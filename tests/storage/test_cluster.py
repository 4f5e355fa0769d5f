"""What only a Redis Cluster can show: migrations and listings that span every master, both ways
of running a single-slot transaction, and a master that dies and comes back.

(The whole storage contract also runs on the cluster: every ``[cluster]`` test id.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from redis.client import Pipeline
from redis.cluster import RedisCluster

import migrations
from cache_service.app import prepare_schema
from cache_service.storage import RedisStore, StorageUnavailable, clients, keys
from cache_service.storage.connect import connect
from tests.storage.conftest import stored
from tests.storage.servers import Cluster


@pytest.fixture
def cluster(cluster_client: RedisCluster) -> RedisCluster:
    return cluster_client


def _one_per_master(cluster: RedisCluster, key: Callable[[str], str], prefix: str) -> list[str]:
    """Names whose keys land on each master in turn (so a test provably spans all of them)."""
    masters = {node.name for node in cluster.get_primaries()}
    chosen: dict[str, str] = {}
    for i in range(1000):
        name = f"{prefix}{i}"
        chosen.setdefault(cluster.get_node_from_key(key(name)).name, name)
        if len(chosen) == len(masters):
            return sorted(chosen.values())
    raise AssertionError(f"no names found for every master: {chosen}")


def test_prepare_schema_initialises_a_fresh_cluster(cluster: RedisCluster) -> None:
    assert prepare_schema(cluster) == migrations.LATEST == 3
    assert cluster.get(keys.SCHEMA_VERSION) == b"3" and cluster.get(keys.MIGRATION_LOCK) is None
    assert prepare_schema(cluster) == 3  # a second replica starting finds it done


def test_v1_logs_on_every_master_are_migrated(cluster: RedisCluster) -> None:
    namespaces = _one_per_master(cluster, keys.log, "ns-")
    for i, ns in enumerate(namespaces):  # logs as v1 replicas wrote them: no token counters
        for n in range(i + 1):
            cluster.xadd(keys.log(ns), {"n": n + 1, "tokens": np.arange(n + 1, dtype="<i4").tobytes()})
    cluster.set(keys.SCHEMA_VERSION, 1)
    assert migrations.run_migrate(cluster, dry_run=False).splitlines()[-1] == "schema now v3"
    assert prepare_schema(cluster) == 3
    store = RedisStore(cluster)
    assert [store.log_size(ns) for ns in namespaces] == [(1, 1), (2, 3), (3, 6)]


def test_v2_dynamic_table_keys_on_every_master_are_dropped(cluster: RedisCluster) -> None:
    sids = _one_per_master(cluster, keys.session_state, "s-")
    store = RedisStore(cluster)
    for sid in sids:  # sessions as v2 replicas saved them: with an (empty) dynamic table
        store.save_session(sid, stored([1, 2], 1), ttl_s=60)
        cluster.set(f"draftcache:v1:session:{{{sid}}}:dyn", b"", px=60_000)
    cluster.set(keys.SCHEMA_VERSION, 2)
    assert migrations.run_migrate(cluster, dry_run=False).splitlines()[-1] == "schema now v3"
    assert not list(cluster.scan_iter(match="*:dyn")) and store.session_ids() == sorted(sids)


def test_session_listing_scans_every_master(cluster: RedisCluster) -> None:
    store = RedisStore(cluster)
    sids = _one_per_master(cluster, keys.session_state, "sess-")
    for sid in sids:
        store.save_session(sid, stored([1], 1), ttl_s=60)
    assert store.session_ids() == sids


def test_transactions_run_on_the_slot_owner_without_cluster_pipelines(
    cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path taken with a redis-py whose cluster pipelines cannot run MULTI/EXEC."""
    monkeypatch.setattr(clients, "CLUSTER_TRANSACTIONS", False)
    assert isinstance(clients.transaction(cluster, keys.log("n")), Pipeline)
    store = RedisStore(cluster)
    store.append_requests("n", [np.array([1, 2], np.int32)])
    assert store.log_size("n") == (1, 2)
    v1, v2 = store.put_prior("n", b"one"), store.put_prior("n", b"two")
    assert store.rollback_prior("n") == v1 and store.get_prior("n") == (v1, b"one")
    assert store.rollback_prior("n") == v2
    store.save_session("s", stored([1, 2], 1, [((1,), [((2,), 1)])]), ttl_s=60)
    loaded = store.load_session("s")
    assert loaded is not None and loaded.snapshot.rejected.items() == [((1,), [((2,), 1)])]
    assert store.touch_session("s", 120) and 115_000 < cluster.pttl(keys.session_rej("s")) <= 120_000


def test_a_dead_master_fails_fast_and_returns_with_its_data(dedicated_cluster: Callable[..., Cluster]) -> None:
    cluster = dedicated_cluster("--appendonly", "yes", "--appendfsync", "always")
    client = connect(cluster.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    assert isinstance(client, RedisCluster)
    store = RedisStore(client)
    victim_ns, other_ns = _one_per_master(client, keys.log, "ns-")[:2]
    victim = next(n for n in cluster.nodes if client.get_node_from_key(keys.log(victim_ns)).port == n.port)
    ids = store.append_requests(victim_ns, [np.array([1, 2, 3], np.int32)])
    store.append_requests(other_ns, [np.array([4], np.int32)])

    victim.kill()
    calls = [lambda: store.read_log(victim_ns), lambda: store.append_requests(victim_ns, [np.array([5], np.int32)])]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(StorageUnavailable):
            call()
        assert time.monotonic() - start < 2.0

    victim.start()  # same port, nodes.conf and AOF: it takes its slots back
    cluster.wait_ok()
    assert [e.id for e in store.read_log(victim_ns)] == ids
    assert store.log_size(victim_ns) == (1, 3) and store.log_size(other_ns) == (1, 1)

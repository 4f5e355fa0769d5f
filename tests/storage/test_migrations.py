"""Key-schema migrations against a real Redis: plan, apply, idempotence, refusal, locking."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import migrations
from cache_service.storage import MigrationInProgress, RedisStore, SchemaMismatch, keys
from cache_service.storage.clients import StorageClient
from tests.storage.conftest import stored


def _v1_log(client: StorageClient, ns: str, requests: list[list[int]]) -> None:
    """A log as v1 replicas wrote it: entries, no token counter."""
    for tokens in requests:
        client.xadd(keys.log(ns), {"n": len(tokens), "tokens": np.array(tokens, "<i4").tobytes()})


def test_fresh_database_plans_everything_and_applies_to_latest(client: StorageClient) -> None:
    assert [m.version for m in migrations.plan(client)] == [1, 2, 3]
    with pytest.raises(SchemaMismatch) as info:
        migrations.check(client)
    assert (info.value.stored, info.value.expected) == (0, 3)
    assert [m.version for m in migrations.apply(client)] == [1, 2, 3]
    assert client.get(keys.SCHEMA_VERSION) == b"3"
    assert migrations.check(client) == 3 == migrations.LATEST
    assert migrations.apply(client) == []  # a second run is a no-op
    assert migrations.plan(client) == []
    assert client.get(keys.MIGRATION_LOCK) is None  # released


def test_v1_data_is_converted_and_preserved(client: StorageClient, store: RedisStore) -> None:
    client.set(keys.SCHEMA_VERSION, 1)
    _v1_log(client, "a", [[1, 2, 3], [4], []])
    _v1_log(client, "acme/b", [[5] * 10])
    client.hset(keys.NAMESPACES, "a", 100)
    before = client.xrange(keys.log("a"))
    assert [m.version for m in migrations.plan(client)] == [2, 3]
    assert [m.version for m in migrations.apply(client)] == [2, 3]
    assert client.xrange(keys.log("a")) == before  # entries untouched
    assert store.log_size("a") == (3, 4) and store.log_size("acme/b") == (1, 10)
    assert store.namespaces() == {"a": 100}
    store.append_requests("a", [np.array([6, 7], np.int32)])  # v2 appends now work
    assert store.log_size("a") == (4, 6)


def test_rerunning_v2_recomputes_the_same_counts(client: StorageClient, store: RedisStore) -> None:
    migrations.apply(client)
    store.append_requests("a", [np.arange(5, dtype=np.int32)])
    migrations.MIGRATIONS[1].apply(client)  # as after a crash before the version was recorded
    assert store.log_size("a") == (1, 5)


def _v2_session(client: StorageClient, store: RedisStore, sid: str) -> None:
    """A session as v2 replicas saved it: state and rejected table, plus an empty dynamic table."""
    store.save_session(sid, stored([1, 2, 3], 2, [((1,), [((2,), 1)])]), ttl_s=600)
    client.set(f"draftcache:v1:session:{{{sid}}}:dyn", b"DCLT\x01" + bytes(19), px=600_000)


def test_v3_drops_the_dynamic_table_keys_and_nothing_else(client: StorageClient, store: RedisStore) -> None:
    client.set(keys.SCHEMA_VERSION, 2)
    sids = [f"s-{i:04d}" for i in range(1500)]  # more than one SCAN step and one round of deletes
    for sid in sids:
        _v2_session(client, store, sid)
    client.set("draftcache:v1:session:{odd}:dyn:note", b"kept")  # matches no v2 key: left alone
    before = {sid: store.load_session(sid) for sid in sids[:3]}
    assert [m.version for m in migrations.apply(client)] == [3]
    assert not list(client.scan_iter(match="*:dyn"))
    assert client.get("draftcache:v1:session:{odd}:dyn:note") == b"kept"
    assert store.session_ids() == sids  # every session still there, with its expiry and table
    for sid, was in before.items():
        now = store.load_session(sid)
        assert now is not None and was is not None
        assert now.snapshot.rejected == was.snapshot.rejected and client.pttl(keys.session_rej(sid)) > 590_000


def test_rerunning_v3_finds_nothing_to_delete(client: StorageClient, store: RedisStore) -> None:
    migrations.apply(client)
    _v2_session(client, store, "late")  # written by a v2 replica still draining
    migrations.MIGRATIONS[2].apply(client)
    migrations.MIGRATIONS[2].apply(client)  # as after a crash before the version was recorded
    assert not list(client.scan_iter(match="*:dyn")) and store.session_ids() == ["late"]


def test_a_newer_schema_is_refused(client: StorageClient) -> None:
    client.set(keys.SCHEMA_VERSION, 99)
    for call in (migrations.check, migrations.plan, migrations.apply):
        with pytest.raises(SchemaMismatch, match="newer") as info:
            call(client)
        assert (info.value.stored, info.value.expected) == (99, 3)
    with pytest.raises(SchemaMismatch):
        migrations.run_migrate(client, dry_run=False)
    assert client.get(keys.SCHEMA_VERSION) == b"99"


def test_dry_run_changes_nothing(client: StorageClient) -> None:
    _v1_log(client, "a", [[1, 2]])
    client.set(keys.SCHEMA_VERSION, 1)
    snapshot = {k: client.dump(k) for k in client.scan_iter()}
    report = migrations.run_migrate(client, dry_run=True)
    assert report.splitlines() == [
        "schema v1, code v3; would apply:",
        "  v2: token counters for lifetime logs (cap by tokens)",
        "  v3: session dynamic-table keys dropped (never read)",
    ]
    assert {k: client.dump(k) for k in client.scan_iter()} == snapshot


def test_run_migrate_reports(client: StorageClient) -> None:
    report = migrations.run_migrate(client, dry_run=False)
    assert report.splitlines()[0] == "schema v0, code v3; applied:"
    assert report.splitlines()[-1] == "schema now v3"
    assert migrations.run_migrate(client, dry_run=False) == "schema v3, code v3; up to date"


def test_one_migrator_at_a_time(client: StorageClient) -> None:
    with migrations.migration_lock(client), pytest.raises(MigrationInProgress):
        migrations.apply(client)
    assert client.get(keys.SCHEMA_VERSION) is None
    assert [m.version for m in migrations.apply(client)] == [1, 2, 3]


def test_a_migrator_that_lost_its_lock_records_nothing(client: StorageClient) -> None:
    def steal(c: StorageClient) -> None:
        c.set(keys.MIGRATION_LOCK, "someone else")  # our lease ran out and another took over

    rogue = migrations.Migration(version=1, description="slow step", apply=steal)
    with pytest.raises(MigrationInProgress, match="lost"):
        migrations.apply(client, [rogue])
    assert client.get(keys.SCHEMA_VERSION) is None
    assert client.get(keys.MIGRATION_LOCK) == b"someone else"  # not released by the loser


def test_racing_migrators_apply_each_step_once(client: StorageClient) -> None:
    calls: list[int] = []
    gate = threading.Event()

    def step(c: StorageClient) -> None:
        calls.append(1)
        gate.wait(2)

    only = migrations.Migration(version=1, description="counted", apply=step)
    outcomes: list[str] = []

    def run() -> None:
        try:
            outcomes.append(f"applied {len(migrations.apply(client, [only]))}")
        except MigrationInProgress:
            outcomes.append("locked out")
            gate.set()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(outcomes) == ["applied 1", "locked out"] and calls == [1]


def test_replicas_starting_together_all_get_the_schema(client: StorageClient) -> None:
    # Four servers start at once on a fresh Redis: one migrates, the others wait for it.
    from cache_service.app import prepare_schema

    results: list[object] = []

    def start() -> None:
        try:
            results.append(prepare_schema(client))
        except Exception as exc:  # a server that could not start
            results.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [migrations.LATEST] * 4


def test_a_step_longer_than_the_lock_ttl_keeps_the_lock(client: StorageClient) -> None:
    # A step on a large dataset outlasts the lock's TTL: the lock is renewed meanwhile, so the
    # step is recorded and nobody else migrates at the same time.
    refused: list[str] = []

    def slow(c: StorageClient) -> None:
        for _ in range(6):
            time.sleep(0.1)
            try:
                with migrations.migration_lock(c, 150):
                    refused.append("taken")
            except MigrationInProgress:
                refused.append("refused")

    only = migrations.Migration(version=1, description="slow step", apply=slow)
    assert migrations.apply(client, [only], lock_ttl_ms=150) == [only]
    assert refused == ["refused"] * 6 and client.get(keys.SCHEMA_VERSION) == b"1"
    assert client.get(keys.MIGRATION_LOCK) is None


def test_a_held_lock_says_when_it_frees(client: StorageClient) -> None:
    client.set(keys.MIGRATION_LOCK, "a migrator that was killed", px=20_000)
    with pytest.raises(MigrationInProgress, match=r"if it died, the lock expires in 20 s"):
        migrations.run_migrate(client, dry_run=False)
    client.persist(keys.MIGRATION_LOCK)
    with pytest.raises(MigrationInProgress, match="no expiry: delete it if no migration is running"):
        migrations.apply(client)
    assert client.get(keys.SCHEMA_VERSION) is None

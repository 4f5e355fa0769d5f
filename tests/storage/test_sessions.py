"""Session copies: one transaction, one expiry, SCAN listing."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from cache_service.storage import RedisStore, StorageCorrupt, StoredSession, keys
from cache_service.storage.clients import StorageClient
from indexer.drafter import DraftParams
from indexer.session import SessionSnapshot
from indexer.session_cache import LruTableConfig, RejectedCache, TableColumns

CONTEXT = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], np.int32)


def _session(context: np.ndarray = CONTEXT, prompt_len: int = 10, budget: int = 32) -> StoredSession:
    rej = RejectedCache(LruTableConfig(leader_len=2, follower_len=3))
    rej.record(context, np.array([11, 12, 13, 14], np.int32))
    rej.record(context[:-1], np.array([15], np.int32))
    snapshot = SessionSnapshot(context=context, prompt_len=prompt_len, rejected=rej.table.columns())
    return StoredSession("acme/llama2", snapshot, DraftParams(budget=budget))


def _bare(session: StoredSession) -> StoredSession:
    """``session`` without a rejected table."""
    return replace(session, snapshot=replace(session.snapshot, rejected=TableColumns.of_items([])))


def _same(got: StoredSession | None, want: StoredSession) -> bool:
    return (
        got is not None
        and (got.namespace, got.params) == (want.namespace, want.params)
        and got.snapshot.context.tolist() == want.snapshot.context.tolist()
        and got.snapshot.prompt_len == want.snapshot.prompt_len
        and got.snapshot.rejected == want.snapshot.rejected
    )


def test_save_load_round_trip(store: RedisStore) -> None:
    session = _session()
    store.save_session("s-1", session, ttl_s=60)
    got = store.load_session("s-1")
    assert _same(got, session) and got is not None
    assert got.namespace == "acme/llama2" and got.snapshot.prompt_len == 10 and got.params == DraftParams(budget=32)
    # Oldest leader first; the branch is cut to follower_len.
    assert got.snapshot.rejected.items() == [((9, 3), [((11, 12, 13), 1)]), ((7, 9), [((15,), 1)])]
    assert store.load_session("s-2") is None


def test_every_key_gets_the_ttl_and_save_or_touch_refresh_it(store: RedisStore, client: StorageClient) -> None:
    session = _session()
    store.save_session("s", session, ttl_s=30)
    ttls = [client.pttl(k) for k in keys.session_keys("s")]
    assert len(ttls) == 2 and all(25_000 < t <= 30_000 for t in ttls)
    store.save_session("s", _bare(session), ttl_s=300)  # a later save refreshes every key
    assert all(295_000 < client.pttl(k) <= 300_000 for k in keys.session_keys("s"))
    assert store.touch_session("s", 1000.5)
    assert all(995_000 < client.pttl(k) <= 1_000_500 for k in keys.session_keys("s"))
    assert not store.touch_session("gone", 10)
    with pytest.raises(ValueError):
        store.touch_session("s", 0)


def test_sessions_expire(store: RedisStore) -> None:
    store.save_session("short", _bare(_session()), ttl_s=0.05)
    assert store.load_session("short") is not None
    time.sleep(0.1)
    assert store.load_session("short") is None  # an expired key is never returned, even before eviction
    assert store.session_ids("short") == []


def test_delete_and_scan_listing(store: RedisStore) -> None:
    session = _bare(_session())
    sids = [f"sess-{i:03d}" for i in range(250)] + ["other-1"]
    for sid in sids:
        store.save_session(sid, session, ttl_s=60)
    assert store.session_ids() == sorted(sids)
    assert store.session_ids("other-*") == ["other-1"]
    assert store.delete_session("other-1")
    assert not store.delete_session("other-1")
    assert store.session_ids("other-*") == []
    assert store.load_session("other-1") is None
    # Many at once (one round trip; per session on a cluster): the missing one is reported.
    assert store.delete_sessions(["sess-000", "other-1", "sess-249"]) == [True, False, True]
    assert store.session_ids() == sids[1:249]
    assert store.delete_sessions([]) == []


def test_a_missing_table_loads_empty_and_garbage_is_corrupt(store: RedisStore, client: StorageClient) -> None:
    session = _session()
    store.save_session("s", session, ttl_s=60)
    client.delete(keys.session_rej("s"))
    assert _same(store.load_session("s"), _bare(session))
    client.set(keys.session_rej("s"), b"garbage")
    with pytest.raises(StorageCorrupt):
        store.load_session("s")
    client.hset(keys.session_state("s"), "fmt", "99")
    with pytest.raises(StorageCorrupt):
        store.load_session("s")


def test_many_sessions_in_one_round_trip_read_back_as_saved_one_by_one(
    store: RedisStore, client: StorageClient
) -> None:
    session = _session()
    store.save_session("old", session, ttl_s=60)
    client.hset(keys.session_state("old"), "stray", "x")  # a field an older save left behind
    writes = [(f"b-{i:03d}", session) for i in range(40)]
    writes.append(("old", _session(CONTEXT[:5], prompt_len=3, budget=8)))
    store.save_sessions(writes, ttl_s=45)
    store.save_sessions([], ttl_s=45)  # nothing to write: no call
    for sid, want in writes:
        assert _same(store.load_session(sid), want)
        assert all(40_000 < client.pttl(k) <= 45_000 for k in keys.session_keys(sid))
    assert client.hget(keys.session_state("old"), "stray") is None  # each session replaced whole
    with pytest.raises(ValueError):
        store.save_sessions(writes[:1], ttl_s=0)


def test_a_save_never_writes_over_another_tenants_session(store: RedisStore, client: StorageClient) -> None:
    theirs = replace(_session(), tenant="acme")
    store.save_session("taken", theirs, ttl_s=60)
    store.save_session("legacy", _session(), ttl_s=60)
    client.hdel(keys.session_state("legacy"), "tenant")  # a record older than the field: nobody's
    mine = replace(_session(CONTEXT[:5], prompt_len=3), tenant="umbrella")
    written = store.save_sessions([("taken", mine), ("free", mine), ("legacy", mine)], ttl_s=60)
    assert written == [False, True, True]
    assert _same(store.load_session("taken"), theirs)  # left as it was, its expiry too
    assert all(50_000 < client.pttl(k) <= 60_000 for k in keys.session_keys("taken"))
    assert _same(store.load_session("free"), mine) and _same(store.load_session("legacy"), mine)
    assert store.save_sessions([("taken", replace(mine, tenant="acme"))], ttl_s=60) == [True]  # its own tenant


def test_appends_extend_exactly_the_context_storage_holds(store: RedisStore, client: StorageClient) -> None:
    session = _session()
    for sid in ("a", "b", "c"):
        store.save_session(sid, session, ttl_s=30)
    n = CONTEXT.size
    grown = RejectedCache(LruTableConfig(leader_len=2, follower_len=3))
    grown.record(np.array([1, 2], np.int32), np.array([7, 7], np.int32))
    applied = store.append_sessions(
        [
            ("a", n, np.array([40, 41], np.int32), None),  # tokens only: the table stays
            ("b", n, np.array([], np.int32), grown.table.items()),  # the table only
            ("c", n - 1, np.array([50], np.int32), None),  # storage holds more than the writer thinks
            ("gone", 0, np.array([60], np.int32), None),  # nothing stored (expired, or storage lost it)
            ("a", n + 2, np.array([42], np.int32), None),  # a second append in the same round trip
        ],
        ttl_s=300,
    )
    assert applied == [True, True, False, False, True]
    a, b, c = (store.load_session(s) for s in ("a", "b", "c"))
    grown_a = replace(session.snapshot, context=np.array([*CONTEXT.tolist(), 40, 41, 42], np.int32))
    assert _same(a, replace(session, snapshot=grown_a))
    assert _same(b, replace(session, snapshot=replace(session.snapshot, rejected=grown.table.columns())))
    assert _same(c, session)  # untouched
    assert store.load_session("gone") is None and client.exists(*keys.session_keys("gone")) == 0
    # Every key of an appended session has the new expiry; the refused one kept its old one.
    assert all(295_000 < client.pttl(k) <= 300_000 for s in ("a", "b") for k in keys.session_keys(s))
    assert all(client.pttl(k) <= 30_000 for k in keys.session_keys("c"))
    assert store.append_sessions([], ttl_s=30) == []
    with pytest.raises(ValueError):
        store.append_sessions([("a", n + 3, np.array([1], np.int32), None)], ttl_s=0)

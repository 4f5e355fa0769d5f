"""Session copies: one transaction, one expiry, SCAN listing."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cache_service.storage import RedisStore, SessionState, StorageCorrupt, keys
from cache_service.storage.clients import StorageClient
from indexer.session_cache import LruTable, LruTableConfig, RejectedCache


def _session() -> tuple[SessionState, LruTable, RejectedCache]:
    context = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], np.int32)
    dyn = LruTable(LruTableConfig(leader_len=2, follower_len=3))  # any table: storage keeps it as given
    ids = context.tolist()
    for i in range(2, len(ids) - 2):
        dyn.add(tuple(ids[i - 2 : i]), tuple(ids[i : i + 3]))
    rej = RejectedCache(LruTableConfig(leader_len=2, follower_len=3))
    rej.record(context, np.array([11, 12, 13, 14], np.int32))
    rej.record(context[:-1], np.array([15], np.int32))
    state = SessionState(namespace="acme/llama2", context=context, prompt_len=10, params={"budget": 32})
    return state, dyn, rej


def test_save_load_round_trip(store: RedisStore) -> None:
    state, dyn, rej = _session()
    store.save_session("s-1", state, dyn.items(), rej.table.items(), ttl_s=60)
    got = store.load_session("s-1")
    assert got is not None
    assert got.state.namespace == "acme/llama2" and got.state.prompt_len == 10
    assert got.state.context.tolist() == state.context.tolist() and dict(got.state.params) == {"budget": 32}
    assert got.dyn == dyn.items() and len(got.dyn) > 5
    # Oldest leader first; the branch is cut to follower_len.
    assert got.rej == rej.table.items() == [((9, 3), [((11, 12, 13), 1)]), ((7, 9), [((15,), 1)])]
    assert store.load_session("s-2") is None


def test_every_key_gets_the_ttl_and_save_or_touch_refresh_it(store: RedisStore, client: StorageClient) -> None:
    state, dyn, rej = _session()
    store.save_session("s", state, dyn.items(), rej.table.items(), ttl_s=30)
    ttls = [client.pttl(k) for k in keys.session_keys("s")]
    assert all(25_000 < t <= 30_000 for t in ttls)
    store.save_session("s", state, [], [], ttl_s=300)  # a later save refreshes every key
    assert all(295_000 < client.pttl(k) <= 300_000 for k in keys.session_keys("s"))
    assert store.touch_session("s", 1000.5)
    assert all(995_000 < client.pttl(k) <= 1_000_500 for k in keys.session_keys("s"))
    assert not store.touch_session("gone", 10)
    with pytest.raises(ValueError):
        store.touch_session("s", 0)


def test_sessions_expire(store: RedisStore) -> None:
    state, _, _ = _session()
    store.save_session("short", state, [], [], ttl_s=0.05)
    assert store.load_session("short") is not None
    time.sleep(0.1)
    assert store.load_session("short") is None  # an expired key is never returned, even before eviction
    assert store.session_ids("short") == []


def test_delete_and_scan_listing(store: RedisStore) -> None:
    state, _, _ = _session()
    sids = [f"sess-{i:03d}" for i in range(250)] + ["other-1"]
    for sid in sids:
        store.save_session(sid, state, [], [], ttl_s=60)
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
    state, dyn, rej = _session()
    store.save_session("s", state, dyn.items(), rej.table.items(), ttl_s=60)
    client.delete(keys.session_rej("s"))
    got = store.load_session("s")
    assert got is not None and got.rej == [] and got.dyn == dyn.items()
    client.set(keys.session_dyn("s"), b"garbage")
    with pytest.raises(StorageCorrupt):
        store.load_session("s")
    client.hset(keys.session_state("s"), "fmt", "99")
    with pytest.raises(StorageCorrupt):
        store.load_session("s")


def test_many_sessions_in_one_round_trip_read_back_as_saved_one_by_one(
    store: RedisStore, client: StorageClient
) -> None:
    state, dyn, rej = _session()
    store.save_session("old", state, dyn.items(), rej.table.items(), ttl_s=60)
    client.hset(keys.session_state("old"), "stray", "x")  # a field an older save left behind
    shorter = SessionState(namespace="acme/llama2", context=state.context[:5], prompt_len=3, params={"budget": 8})
    writes = [(f"b-{i:03d}", state, dyn.items(), rej.table.items()) for i in range(40)]
    writes.append(("old", shorter, [], rej.table.items()))
    store.save_sessions(writes, ttl_s=45)
    store.save_sessions([], ttl_s=45)  # nothing to write: no call
    for sid, st, d, r in writes:
        got = store.load_session(sid)
        assert got is not None
        assert got.state.context.tolist() == st.context.tolist() and got.state.prompt_len == st.prompt_len
        assert dict(got.state.params) == dict(st.params) and got.dyn == d and got.rej == r
        assert all(40_000 < client.pttl(k) <= 45_000 for k in keys.session_keys(sid))
    assert client.hget(keys.session_state("old"), "stray") is None  # each session replaced whole
    with pytest.raises(ValueError):
        store.save_sessions(writes[:1], ttl_s=0)


def test_appends_extend_exactly_the_context_storage_holds(store: RedisStore, client: StorageClient) -> None:
    state, dyn, rej = _session()
    for sid in ("a", "b", "c"):
        store.save_session(sid, state, dyn.items(), rej.table.items(), ttl_s=30)
    n = state.context.size
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
    assert a is not None and a.state.context.tolist() == [*state.context.tolist(), 40, 41, 42]
    assert a.rej == rej.table.items() and a.dyn == dyn.items() and a.state.prompt_len == 10
    assert b is not None and b.state.context.tolist() == state.context.tolist() and b.rej == grown.table.items()
    assert c is not None and c.state.context.tolist() == state.context.tolist()  # untouched
    assert store.load_session("gone") is None and client.exists(*keys.session_keys("gone")) == 0
    # Every key of an appended session has the new expiry; the refused one kept its old one.
    assert all(295_000 < client.pttl(k) <= 300_000 for s in ("a", "b") for k in keys.session_keys(s))
    assert all(client.pttl(k) <= 30_000 for k in keys.session_keys("c"))
    assert store.append_sessions([], ttl_s=30) == []
    with pytest.raises(ValueError):
        store.append_sessions([("a", n + 3, np.array([1], np.int32), None)], ttl_s=0)

"""Lifetime log contract: round trips, an exact token cap, followers, concurrent writers."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from cache_service.storage import RedisStore, StorageCorrupt, StoreConfig, keys
from cache_service.storage.clients import StorageClient
from cache_service.storage.stream_log import LogReplaced, NotReplicated


def _req(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def _stored_tokens(client: StorageClient, ns: str) -> int:
    """The truth, recomputed from the entries themselves."""
    return sum(int(fields[b"n"]) for _, fields in client.xrange(keys.log(ns)))


def test_append_then_read_round_trips(store: RedisStore) -> None:
    ids = store.append_requests("ns", [_req(1, 2, 3), _req(), _req(2**31 - 1)])
    entries = store.read_log("ns")
    assert [e.id for e in entries] == ids  # one id per request, in order
    assert [e.tokens.tolist() for e in entries] == [[1, 2, 3], [], [2**31 - 1]]
    assert all(e.tokens.dtype == np.int32 for e in entries)
    assert store.log_size("ns") == (3, 4)
    assert store.read_log("other") == []  # namespaces never mix


def test_stream_fields_are_n_and_little_endian_tokens(store: RedisStore, client: StorageClient) -> None:
    [entry_id] = store.append_requests("ns", [_req(1, 256)])
    [(raw_id, fields)] = client.xrange(keys.log("ns"))
    assert raw_id.decode() == entry_id
    assert fields == {b"n": b"2", b"tokens": b"\x01\x00\x00\x00\x00\x01\x00\x00"}


def test_read_pages_after_an_id(store: RedisStore) -> None:
    ids = store.append_requests("ns", [_req(i) for i in range(5)])
    first = store.read_log("ns", count=2)
    assert [e.tokens.tolist() for e in first] == [[0], [1]]
    rest = store.read_log("ns", after_id=first[-1].id)
    assert [e.id for e in rest] == ids[2:]
    assert store.read_log("ns", after_id=ids[-1]) == []


def test_token_cap_is_exact_and_keeps_the_newest(store: RedisStore, client: StorageClient) -> None:
    for i in range(4):
        store.append_requests("ns", [_req(*[i] * 30)], max_tokens=100)
    # 120 tokens appended: the oldest whole request goes, three remain.
    assert [e.tokens[0] for e in store.read_log("ns")] == [1, 2, 3]
    assert store.log_size("ns") == (3, 90) and _stored_tokens(client, "ns") == 90
    store.append_requests("ns", [_req(*[7] * 11)], max_tokens=100)  # 101 > 100: drop one more
    assert [e.tokens[0] for e in store.read_log("ns")] == [2, 3, 7]
    assert store.log_size("ns") == (3, 71)


def test_a_request_longer_than_the_cap_keeps_its_tail(store: RedisStore) -> None:
    store.append_requests("ns", [_req(1, 2)], max_tokens=5)
    store.append_requests("ns", [_req(*range(10))], max_tokens=5)
    assert [e.tokens.tolist() for e in store.read_log("ns")] == [[5, 6, 7, 8, 9]]
    assert store.log_size("ns") == (1, 5)


def test_one_batch_larger_than_the_cap_trims_within_itself(store: RedisStore, client: StorageClient) -> None:
    batch = [_req(*[7] * n) for n in range(1, 101)]  # 5,050 tokens against the store's cap of 1,000
    store.append_requests("ns", batch)
    sizes = [e.tokens.size for e in store.read_log("ns", count=10_000)]
    assert sizes == list(range(91, 101))  # 91 + ... + 100 = 955; adding 90 would make 1,045
    assert _stored_tokens(client, "ns") == store.log_size("ns")[1] == 955


def test_follow_returns_new_entries_and_times_out_empty(store: RedisStore) -> None:
    [first] = store.append_requests("ns", [_req(1)])
    assert store.follow("ns", first, block_ms=50) == []
    got: list[list[int]] = []
    reader = threading.Thread(
        target=lambda: got.extend(e.tokens.tolist() for e in store.follow("ns", first, block_ms=5000))
    )
    reader.start()
    store.append_requests("ns", [_req(2, 3)])
    reader.join(5)
    assert got == [[2, 3]]
    assert [e.tokens.tolist() for e in store.follow("ns", "0", block_ms=None)] == [[1], [2, 3]]
    with pytest.raises(ValueError):
        store.follow("ns", first, block_ms=0)  # would block forever


def test_concurrent_appends_keep_the_counter_exact(store: RedisStore, client: StorageClient) -> None:
    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(100):
            batch = [rng.integers(0, 100, rng.integers(1, 40)).astype(np.int32) for _ in range(rng.integers(1, 4))]
            store.append_requests("ns", batch, max_tokens=500)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries, tokens = store.log_size("ns")
    assert tokens == _stored_tokens(client, "ns")
    assert 500 - 40 < tokens <= 500  # full, within one request of the cap
    assert entries == len(store.read_log("ns", count=10_000))


def test_invalid_requests_are_refused_before_writing(store: RedisStore) -> None:
    with pytest.raises(ValueError):
        store.append_requests("ns", [_req(1), np.array([1, 2], dtype=np.int64)])
    with pytest.raises(ValueError):
        store.append_requests("bad name", [_req(1)])
    with pytest.raises(ValueError):
        store.read_log("ns", after_id="nope")
    assert store.log_size("ns") == (0, 0)
    assert store.append_requests("ns", []) == []


def test_a_log_without_its_counter_is_refused(store: RedisStore, client: StorageClient) -> None:
    client.xadd(keys.log("ns"), {"n": 1, "tokens": b"\x01\x00\x00\x00"})  # written by a v1 replica
    with pytest.raises(StorageCorrupt, match="migrate"):
        store.append_requests("ns", [_req(2)])
    assert client.xlen(keys.log("ns")) == 1  # nothing half-written


def test_corrupt_entries_are_reported(store: RedisStore, client: StorageClient) -> None:
    client.xadd(keys.log("ns"), {"n": 2, "tokens": b"\x01\x00\x00\x00"})
    with pytest.raises(StorageCorrupt, match="n=2"):
        store.read_log("ns")
    client.delete(keys.log("ns"))
    client.set(keys.log("ns"), b"not a stream")
    with pytest.raises(StorageCorrupt):
        store.read_log("ns")


def test_commits_with_ids_are_appended_once(store: RedisStore, client: StorageClient) -> None:
    a, b = b"a" * 16, b"b" * 16
    first = store.append_commits("ns", [(a, 0, _req(1)), (a, 1, _req(2)), (b, 0, _req(3))])
    assert all(first)
    # A replay of an append whose answer was lost (and b's next commit): only the new one lands.
    again = store.append_commits("ns", [(a, 0, _req(1)), (a, 1, _req(2)), (b, 1, _req(4))])
    assert again[:2] == [None, None] and again[2] is not None
    assert [e.tokens.tolist() for e in store.read_log("ns")] == [[1], [2], [3], [4]]
    assert store.log_size("ns") == (4, 4)  # the token counter counts what was appended
    # Each namespace remembers its own writers, for a while (hash-tagged with the namespace).
    assert client.hgetall(keys.log_writers("ns")) == {a: b"1", b: b"1"}
    assert 0 < client.ttl(keys.log_writers("ns")) <= store.config.writer_ttl_s
    assert all(store.append_commits("other", [(a, 0, _req(1))]))


def test_a_commit_whose_key_the_log_recorded_is_appended_once(store: RedisStore, client: StorageClient) -> None:
    """A client that never got its close's answer commits the request again under another
    session, and the service gives that commit a new id: the key it names both with is what
    tells the log it holds it already."""
    a, b = b"a" * 16, b"b" * 16
    key, other = "k" * 32, "x" * 32
    assert all(store.append_commits("ns", [(a, 0, _req(1, 2), key)]))
    # The retry, through another replica (writer b) or a later commit of the same one (a, 1).
    assert store.append_commits("ns", [(b, 0, _req(1, 2), key), (a, 1, _req(1, 2), key)]) == [None, None]
    # Twice in one append: the first lands. Commits without a key are never compared.
    again = store.append_commits("ns", [(a, 2, _req(3), other), (b, 1, _req(3), other), (a, 3, _req(4), "")])
    assert again[0] is not None and again[1] is None and again[2] is not None
    assert all(store.append_commits("ns", [(b, 2, _req(4), "")]))
    assert [e.tokens.tolist() for e in store.read_log("ns")] == [[1, 2], [3], [4], [4]]
    assert [e.key for e in store.read_log("ns")] == [key, other, "", ""]  # an entry names its key
    assert store.log_size("ns") == (4, 5)
    # A skipped commit still counts as its writer's: its journal's replay skips it by seq.
    assert client.hgetall(keys.log_writers("ns")) == {a: b"3", b: b"2"}
    assert store.append_commits("ns", [(b, 0, _req(1, 2), "")]) == [None]
    # The keys are the namespace's own (hash-tagged with it) and kept a while.
    assert {m.decode() for m in client.zrange(keys.log_commit_keys("ns"), 0, -1)} == {key, other}
    assert 0 < client.pttl(keys.log_commit_keys("ns")) <= store.config.commit_key_ttl_s * 1000
    assert all(store.append_commits("other", [(a, 0, _req(1, 2), key)]))
    store.delete_namespace("ns")  # and go with it
    assert not client.exists(keys.log_commit_keys("ns"))


def test_a_log_keeps_its_latest_commit_keys_for_a_while(client: StorageClient) -> None:
    """The keys are bounded by count and by age: a retry past either is appended again."""
    store = RedisStore(client, StoreConfig(max_commit_keys=2, commit_key_ttl_s=1))
    a = b"a" * 16
    first, second, third = (c * 32 for c in "pqr")
    assert all(store.append_commits("ns", [(a, 0, _req(1), first), (a, 1, _req(2), second), (a, 2, _req(3), third)]))
    assert client.zcard(keys.log_commit_keys("ns")) == 2
    assert store.append_commits("ns", [(a, 3, _req(2), second), (a, 4, _req(3), third)]) == [None, None]
    assert all(store.append_commits("ns", [(a, 5, _req(1), first)]))  # pushed out by the newer ones
    time.sleep(1.1)
    assert all(store.append_commits("ns", [(a, 6, _req(3), third)]))  # older than the window
    assert len(store.read_log("ns")) == 5


def test_a_commit_key_is_checked_before_writing(store: RedisStore) -> None:
    a = b"a" * 16
    for bad in ("k" * 65, "\u00e9" * 16, b"k" * 16):
        with pytest.raises(ValueError):
            store.append_commits("ns", [(a, 0, _req(1), bad)])
    assert store.read_log("ns") == []


def test_commits_made_for_another_log_are_refused_whole(store: RedisStore) -> None:
    """A commit names the log it was made for: once the namespace is deleted (and created again,
    with a new log), its commits append nothing, journaled or not."""
    a = b"a" * 16
    store.register_namespace("ns", 100)
    old = store.log_identity("ns")
    assert store.append_commits("ns", [(a, 0, _req(1))], log=old) != [None]
    store.delete_namespace("ns")
    with pytest.raises(LogReplaced):
        store.append_commits("ns", [(a, 1, _req(2))], log=old)  # deleted: no log at all
    store.register_namespace("ns", 50)
    new = store.log_identity("ns")
    assert new != old
    with pytest.raises(LogReplaced):
        store.append_commits("ns", [(a, 2, _req(3)), (a, 3, _req(4))], log=old)
    assert store.read_log("ns") == []
    assert all(store.append_commits("ns", [(a, 4, _req(5))], log=new))
    assert all(store.append_commits("ns", [(a, 5, _req(6))]))  # not known: not checked
    assert [e.tokens.tolist() for e in store.read_log("ns")] == [[5], [6]]


def test_an_append_waits_for_replicas_on_its_own_connection(store: RedisStore) -> None:
    """Asked for a replica the server does not have, the append lands and says it is not
    replicated (on a cluster, from the master owning the namespace's slot)."""
    a = b"a" * 16
    with pytest.raises(NotReplicated) as unconfirmed:
        store.append_commits("ns", [(a, 0, _req(1))], replicas=1, wait_ms=50)
    assert unconfirmed.value.ids[0] is not None
    assert store.append_commits("ns", [(a, 1, _req(2))]) != [None]
    assert [e.tokens.tolist() for e in store.read_log("ns")] == [[1], [2]]

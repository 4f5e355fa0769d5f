"""Pure byte layouts: round trips, and garbage refused as StorageCorrupt."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_service.storage import StorageCorrupt, codec, stored_session
from cache_service.storage.stored_session import StoredSession
from indexer.drafter import DraftParams
from indexer.kernels import lru
from indexer.session import SessionSnapshot
from indexer.session_cache import LruTable, LruTableConfig, TableColumns


def _table(seed: int, config: LruTableConfig) -> LruTable:
    rng = np.random.default_rng(seed)
    table = LruTable(config)
    for _ in range(500):
        leader = tuple(rng.integers(0, 20, config.leader_len).tolist())
        follower = tuple(rng.integers(0, 32000, rng.integers(1, config.follower_len + 1)).tolist())
        table.add(leader, follower)
    return table


def test_lru_table_round_trip_replays_to_the_same_table() -> None:
    config = LruTableConfig(leader_len=2, follower_len=8, max_leaders=64, max_followers=4)
    table = _table(0, config)
    decoded = codec.decode_table(codec.encode_table(table.items()))
    assert decoded == table.items()
    replayed = LruTable(config)
    for leader, followers in decoded:
        for follower, count in followers:
            replayed.add(leader, follower, count)
    assert replayed.items() == table.items()  # same order, so the same LRU victims next


@pytest.mark.parametrize("seed", range(3))
def test_a_tables_columns_are_its_entries_in_replay_order(seed: int) -> None:
    config = LruTableConfig(leader_len=1 + seed, follower_len=3 + 2 * seed, max_leaders=16, max_followers=2 + seed)
    table = _table(seed, config)  # more leaders than it keeps, and more followers per leader
    slots, keys = lru.leaders_oldest_first(table.array)
    read_slot_by_slot = []
    for slot, key in zip(slots.tolist(), keys.tolist(), strict=True):
        rows, lengths, counts = (x.tolist() for x in lru.followers_at(table.array, slot, False))
        followers = [(tuple(r[:n]), c) for r, n, c in zip(rows, lengths, counts, strict=True)]
        read_slot_by_slot.append((tuple(key), followers))
    columns = table.columns()
    assert len(columns) == len(table) == 16
    assert columns.items() == read_slot_by_slot
    assert codec.encode_table(columns) == codec.encode_table(read_slot_by_slot)
    assert TableColumns.of_items(read_slot_by_slot).items() == read_slot_by_slot


def test_empty_table_round_trips() -> None:
    assert codec.decode_table(codec.encode_table([])) == []


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 2**31 - 1), max_size=4).map(tuple),
            st.lists(st.tuples(st.lists(st.integers(0, 2**31 - 1), max_size=9).map(tuple), st.integers(0, 2**31 - 1))),
        ),
        max_size=8,
    )
)
def test_any_table_round_trips(items: codec.TableItems) -> None:
    assert codec.decode_table(codec.encode_table(items)) == items


def test_counts_saturate_and_out_of_range_tokens_are_refused() -> None:
    assert codec.decode_table(codec.encode_table([((1,), [((2,), 2**40)])])) == [((1,), [((2,), 2**31 - 1)])]
    with pytest.raises(ValueError):
        codec.encode_table([((2**31,), [((2,), 1)])])
    with pytest.raises(ValueError):
        codec.encode_table([((1,), [((2,), -1)])])


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:10],  # shorter than the header
        lambda b: b"XXXX" + b[4:],  # wrong magic
        lambda b: b[:-4],  # truncated body
        lambda b: b + b"\0\0\0\0",  # trailing bytes
        lambda b: b[:24] + (-1).to_bytes(4, "little", signed=True) + b[28:],  # negative leader length
        lambda b: b[:24] + (3).to_bytes(4, "little") + b[28:],  # lengths no longer add up
    ],
)
def test_garbage_tables_are_corrupt(mangle: Callable[[bytes], bytes]) -> None:
    blob = codec.encode_table([((1, 2), [((3, 4), 1)]), ((5, 6), [((7,), 2)])])
    with pytest.raises(StorageCorrupt):
        codec.decode_table(mangle(blob))


def test_tokens_round_trip_little_endian() -> None:
    tokens = np.array([0, 1, 2**31 - 1, 65536], dtype=np.int32)
    raw = codec.tokens_to_bytes(tokens)
    assert raw[:8] == b"\0\0\0\0\x01\0\0\0"
    back = codec.tokens_from_bytes(raw)
    assert back.dtype == np.int32 and back.tolist() == tokens.tolist()
    with pytest.raises(StorageCorrupt):
        codec.tokens_from_bytes(b"\0\0\0")
    with pytest.raises(ValueError):
        codec.tokens_to_bytes(np.array([1, 2], dtype=np.int64))


def _stored(context: list[int], prompt_len: int) -> StoredSession:
    snapshot = SessionSnapshot(context=np.array(context, np.int32), prompt_len=prompt_len)
    return StoredSession("acme/llama2", snapshot, DraftParams(budget=64, min_score=0.5))


def test_stored_session_round_trip() -> None:
    session = _stored([5, 6, 7, 8], 3)
    fields, rej = stored_session.encode(session)
    params = {"budget": 64, "depth_reserve": 8, "max_depth": 32, "min_score": 0.5}
    assert json.loads(fields[b"params"]) == {**params, "chain": 0, "chain_min_prob": 0.0}
    back = stored_session.decode(fields, rej)
    assert (back.namespace, back.snapshot.prompt_len, back.params) == ("acme/llama2", 3, session.params)
    # Params stored before chain mode existed read back as trees.
    older = stored_session.decode({**fields, b"params": json.dumps(params).encode()}, rej)
    assert older.params == session.params and older.params.chain == 0
    assert back.snapshot.context.tolist() == [5, 6, 7, 8] and back.snapshot.context.flags.writeable
    assert back.snapshot.rejected == session.snapshot.rejected
    assert stored_session.decode(fields, None).snapshot.rejected == codec.empty_columns()  # a lost table


def test_a_stored_session_keeps_its_tenant_and_older_records_belong_to_no_tenant() -> None:
    fields, rej = stored_session.encode(replace(_stored([5, 6], 1), tenant="acme"))
    assert fields[b"tenant"] == b"acme" and stored_session.decode(fields, rej).tenant == "acme"
    # Written before the field existed: the unauthenticated tenant "", which no token names.
    older = {k: v for k, v in fields.items() if k != b"tenant"}
    assert stored_session.decode(older, rej).tenant == ""
    with pytest.raises(StorageCorrupt):
        stored_session.decode({**fields, b"tenant": b"\xff"}, rej)


def test_a_context_that_is_not_int32_is_not_encoded() -> None:
    session = _stored([1], 0)
    with pytest.raises(ValueError):
        stored_session.encode(replace(session, snapshot=replace(session.snapshot, context=np.array([1], np.int64))))


@pytest.mark.parametrize("field", [b"fmt", b"namespace", b"context", b"prompt_len", b"params"])
def test_broken_session_state_is_corrupt(field: bytes) -> None:
    fields, rej = stored_session.encode(_stored([1, 2], 1))
    broken = {**fields, field: b"\xff{"}
    with pytest.raises(StorageCorrupt):
        stored_session.decode(broken, rej)
    missing = {k: v for k, v in fields.items() if k != field}
    with pytest.raises(StorageCorrupt):
        stored_session.decode(missing, rej)


@pytest.mark.parametrize(
    ("field", "value"), [(b"prompt_len", b"3"), (b"params", b'{"budget": -1}'), (b"params", b"[]")]
)
def test_session_state_out_of_range_is_corrupt(field: bytes, value: bytes) -> None:
    fields, rej = stored_session.encode(_stored([1, 2], 1))
    with pytest.raises(StorageCorrupt):
        stored_session.decode({**fields, field: value}, rej)

"""Successor rows in a real Redis (single server and cluster): written with a change entry,
read whole, and read as the changes other writers made."""

from __future__ import annotations

import numpy as np
import pytest

from cache_service.storage import keys
from cache_service.storage.redis_store import RedisStore
from indexer.successors import SuccessorTable, pack_rows, unpack_rows


def _table(prev: list[int], rows: list[list[int]]) -> SuccessorTable:
    table = SuccessorTable(vocab_size=50)
    table.observe(np.array(prev, np.int32), np.array(rows, np.int32))
    return table


def test_rows_round_trip_and_changes_skip_the_reader_own(client) -> None:  # type: ignore[no-untyped-def]
    store = RedisStore(client)
    tokens, packed, last = store.read_successors("toy")
    assert tokens.size == 0 and packed == [] and last == "0-0"
    a = _table([3, 4], [[4, 7], [5, -1]])
    changed, rows = a.take_changed()
    assert sorted(changed.tolist()) == [3, 4]
    assert a.take_changed()[0].size == 0  # taken once
    store.save_successors("toy", "writer-a", changed, rows)
    # A fresh replica reads every row.
    b = SuccessorTable(vocab_size=50)
    tokens, packed, last = store.read_successors("toy")
    assert b.load(tokens, packed) == 2 and b.followers_of(3) == [4, 7] and b.followers_of(4) == [5]
    # Changes after ``last``: none yet; then a's next write, never b's own.
    assert store.successor_changes("toy", last, "writer-b")[0].size == 0
    a.observe(np.array([9], np.int32), np.array([[1, 2]], np.int32))
    store.save_successors("toy", "writer-a", *a.take_changed())
    b.observe(np.array([8], np.int32), np.array([[6, 2]], np.int32))
    store.save_successors("toy", "writer-b", *b.take_changed())
    tokens, packed, newer = store.successor_changes("toy", last, "writer-b")
    assert tokens.tolist() == [9] and newer != last
    assert b.load(tokens, packed) == 1 and b.followers_of(9) == [1, 2]
    assert store.successor_changes("toy", newer, "writer-b")[0].size == 0


def test_a_row_changed_here_is_not_overwritten_by_storage() -> None:
    a = _table([3], [[4, 7]])
    other = _table([3], [[9, 8]])
    tokens, packed = other.take_changed()
    assert a.load(tokens, packed) == 0 and a.followers_of(3) == [4, 7]  # not yet written here
    a.take_changed()
    assert a.load(tokens, packed) == 1 and a.followers_of(3) == [9, 8]


def test_damaged_rows_are_refused() -> None:
    f, w, n = np.zeros((1, 8), np.int32), np.zeros((1, 8)), np.ones(1)
    with pytest.raises(ValueError, match="68 bytes"):
        unpack_rows([b"\x00" * 10])
    with pytest.raises(ValueError, match="finite"):
        unpack_rows(pack_rows(f, np.full((1, 8), np.nan), n))
    assert unpack_rows(pack_rows(f, w, n))[2].tolist() == [1.0]


def test_the_keys_are_the_namespace_s() -> None:
    assert keys.successors("toy").startswith("draftcache:v1:ns:{toy}")
    assert keys.successor_changes("toy").startswith("draftcache:v1:ns:{toy}")

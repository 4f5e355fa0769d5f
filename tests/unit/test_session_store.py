"""The session store: rows held and let go, arrays followed when a compiled step replaces them."""

import numpy as np

from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.kernels import store as kstore
from indexer.session import Session
from indexer.session_cache import LruTableConfig
from indexer.session_store import SessionStore
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree

NS = Namespace(name="store", vocab_size=50)


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _session(prompt=(1, 2, 3)):
    return Session(_a(prompt), LruTableConfig(), None)


def test_rows_are_reused_once_let_go():
    store = SessionStore()
    a, b, c = _session(), _session(), _session()
    assert [store.hold(s) for s in (a, b)] == [0, 1]
    assert store.hold(a) == 0  # held already: the same row
    store.release(a)
    assert a not in store and store.held == 1
    # The released row's arrays are let go (the session keeps its own).
    assert kstore.get_i32(store.i32, 0).size == 0 and a.context.tokens.tolist() == [1, 2, 3]
    assert store.hold(c) == 0 and store.held == 2
    store.release(a)  # not held: nothing happens
    assert store.held == 2 and store.row_of(c) == 0 and store.row_of(a) is None


def test_a_session_drafted_by_two_drafters_is_listed_in_step_by_each():
    one, two = NamespaceDrafter(NS, DrafterConfig()), NamespaceDrafter(NS, DrafterConfig())
    s = one.open([5, 6, 7, 5, 6])
    one.draft(s, DraftParams())
    assert two.draft(s, DraftParams()).tokens.tolist()[:1] == [7]  # "5 6" was followed by 7
    assert s in one.store and s in two.store
    # Accepted through the second store, past the first context buffer's 64 tokens: the
    # first store lists the replacement when it next drafts for the session.
    two.accept(s, np.arange(8, 48, dtype=np.int32))
    two.accept(s, np.arange(8, 48, dtype=np.int32))
    row = one.store.hold(s)
    assert np.shares_memory(kstore.get_i32(one.store.i32, row * kstore.I32_PER_ROW + kstore.CTX), s.context.buffer)
    assert one.draft(s, DraftParams()).tokens.tolist()[:1] == [8]  # "46 47" was followed by 8 (from "... 47 8 9")
    one.release(s)
    assert s not in one.store and s in two.store


def test_context_and_table_grown_by_the_compiled_step_are_the_sessions():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open([1, 2, 3])
    rng = np.random.default_rng(0)
    produced: list[int] = []
    for _ in range(60):  # well past the first buffer's 64 tokens and the table's first slots
        d.draft(s, DraftParams())
        new = rng.integers(0, 50, size=3).astype(np.int32)
        d.accept(s, new)
        produced.extend(new.tolist())
    assert s.context.tokens.tolist() == [1, 2, 3, *produced]
    # What the store holds is what the session holds, after every replacement.
    row = d.store.row_of(s)
    assert row is not None
    at32, at64 = row * kstore.I32_PER_ROW, row * kstore.I64_PER_ROW
    assert np.shares_memory(kstore.get_i32(d.store.i32, at32 + kstore.CTX), s.context.buffer)
    assert np.shares_memory(kstore.get_i64(d.store.i64, at64 + kstore.REJECTED_TABLE), s.rejected.table.array)
    assert len(s.rejected.table) > 4  # it outgrew its first slots
    # A session rebuilt from the same history drafts the same tree.
    again = d.resume(s.snapshot())
    again.hints = s.hints
    a, b = d.draft(s, DraftParams()), d.draft(again, DraftParams())
    assert a.tokens.tolist() == b.tokens.tolist() and a.scores.tolist() == b.scores.tolist()


def test_closing_lets_the_row_go():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open([1, 2, 3, 1, 2])
    d.draft(s, DraftParams())
    d.accept(s, [3])
    assert d.store.held == 1
    added = d.close(s)
    assert d.store.held == 0 and added is not None and added.tolist() == [1, 2, 3, 1, 2, 3]


def test_arrays_replaced_in_python_are_listed_at_the_next_hold():
    store, s = SessionStore(), _session()
    row = store.hold(s)
    at32 = row * kstore.I32_PER_ROW
    s.last_tree = DraftTree(_a([4]), _a([-1]), _a([1]), np.ones(1, dtype=np.float32))
    assert np.shares_memory(kstore.get_i32(store.i32, at32 + kstore.TREE), s.tree_buffer)  # written in place
    table = s.rejected.table.array
    s.rejected.table.add((1, 2), (3,))
    assert s.rejected.table.array is table  # room left: the same array, nothing to list again
    for i in range(100):  # past the table's first slots
        s.rejected.table.add((i, i), (i,))
    n = 100  # past the first buffer's 64 nodes
    s.last_tree = DraftTree(_a(range(n)), _a(range(-1, n - 1)), np.ones(n, np.int32), np.ones(n, np.float32))
    s.context.extend(_a(range(100)))  # past the first context buffer's 64 tokens
    assert not np.shares_memory(kstore.get_i32(store.i32, at32 + kstore.TREE), s.tree_buffer)
    assert store.hold(s) == row
    assert np.shares_memory(kstore.get_i32(store.i32, at32 + kstore.TREE), s.tree_buffer)
    assert np.shares_memory(kstore.get_i32(store.i32, at32 + kstore.CTX), s.context.buffer)
    at64 = row * kstore.I64_PER_ROW
    assert s.rejected.table.array is not table
    assert np.shares_memory(kstore.get_i64(store.i64, at64 + kstore.REJECTED_TABLE), s.rejected.table.array)

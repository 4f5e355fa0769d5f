"""The session store: rows held and let go, arrays followed when a compiled step replaces them."""

import numpy as np

from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.kernels import store as kstore
from indexer.session import Session
from indexer.session_store import SessionStore
from indexer.tokens import Namespace

NS = Namespace(name="store", vocab_size=50)


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _session(prompt=(1, 2, 3)):
    return Session(_a(prompt), DrafterConfig(), None)


def test_rows_are_reused_once_let_go():
    store = SessionStore()
    a, b, c = _session(), _session(), _session()
    assert [store.hold(s) for s in (a, b)] == [0, 1]
    assert store.hold(a) == 0  # held already: the same row
    store.release(a)
    assert a.row == -1 and a.store is None and store.held == 1
    # The released row's arrays are let go (the session keeps its own).
    assert kstore.get_i32(store.i32, 0).size == 0 and a.context.tokens.tolist() == [1, 2, 3]
    assert store.hold(c) == 0 and store.held == 2
    store.release(a)  # not held: nothing happens
    assert store.held == 2 and c.row == 0


def test_a_session_drafted_elsewhere_moves_to_that_store():
    one, two = NamespaceDrafter(NS, DrafterConfig()), NamespaceDrafter(NS, DrafterConfig())
    s = one.open([5, 6, 7, 5, 6])
    one.draft(s, DraftParams())
    assert s.store is one.store and one.store.held == 1
    tree = two.draft(s, DraftParams())
    assert s.store is two.store and one.store.held == 0 and two.store.held == 1
    assert tree.tokens.tolist()[:1] == [7]  # "5 6" was followed by 7


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
    at32, at64 = s.row * kstore.I32_PER_ROW, s.row * kstore.I64_PER_ROW
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

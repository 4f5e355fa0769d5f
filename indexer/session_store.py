"""A namespace's sessions, by row, for compiled steps over a batch of them.

Each session keeps its arrays (:class:`~indexer.session.Session`); the store lists the same
arrays by row in numba typed lists (:mod:`indexer.kernels.store`), so one compiled call reads
and updates a batch of sessions in place, with no interpreter work per session. A session is
held from its first draft or accepted tokens until it is released (closed, or dropped by the
service); rows are reused.

An array that is replaced (a context buffer or rejected table that outgrew its room) is
replaced in both places: by the session's callbacks when it grows in Python, and by
:meth:`SessionStore.follow` after a compiled step grew it.
"""

from __future__ import annotations

import numpy as np

from indexer.kernels import store as kstore
from indexer.kernels.store import GREW_CONTEXT, GREW_TABLE, GREW_TREE
from indexer.session import Session

_EMPTY = np.zeros(0, dtype=np.int32)


class SessionStore:
    """Rows of session arrays.

    >>> from indexer.drafter import DrafterConfig
    >>> store = SessionStore()
    >>> s = Session(np.array([1, 2, 3], dtype=np.int32), DrafterConfig(), None)
    >>> store.hold(s), s.row, store.held
    (0, 0, 1)
    >>> store.release(s); s.row, store.held
    (-1, 0)
    """

    def __init__(self) -> None:
        self.i32, self.i64 = kstore.new_lists()
        self._rows = 0
        self._free: list[int] = []

    @property
    def held(self) -> int:
        """Sessions held now."""
        return self._rows - len(self._free)

    def hold(self, session: Session) -> int:
        """The session's row, holding it first if needed (taking it over from another store)."""
        if session.store is self:
            return session.row
        if session.store is not None:
            session.store.release(session)
        row = self._free.pop() if self._free else self._rows
        if row == self._rows:
            self._rows += 1
        ctx, table = session.context, session.rejected.table
        sa_tokens, sa = ctx.prompt_index
        exact = _EMPTY if session.exact is None else session.exact
        kstore.put_row(
            self.i32, self.i64, row, ctx.buffer, sa_tokens, sa, exact, session.tree_buffer, session.state, table.array
        )
        session.row, session.store = row, self
        at32, at64 = row * kstore.I32_PER_ROW, row * kstore.I64_PER_ROW
        ctx.moved = lambda buffer: kstore.put_i32(self.i32, at32 + kstore.CTX, buffer)
        table.moved = lambda array: kstore.put_i64(self.i64, at64 + kstore.REJECTED_TABLE, array)
        session.tree_moved = lambda buffer: kstore.put_i32(self.i32, at32 + kstore.TREE, buffer)
        return row

    def release(self, session: Session) -> None:
        """Let the session's row go (the session keeps its arrays); a no-op if not held here."""
        if session.store is not self:
            return
        row = session.row
        kstore.put_row(self.i32, self.i64, row, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _STATE, _STATE)
        session.row, session.store = -1, None
        session.context.moved = session.rejected.table.moved = session.tree_moved = None
        self._free.append(row)

    def follow(self, session: Session, grown: int) -> None:
        """Take up the arrays a compiled step replaced for a held session: ``grown`` has bit
        :data:`GREW_CONTEXT` for its context buffer, :data:`GREW_TABLE` for its rejected table,
        :data:`GREW_TREE` for its last tree's buffer."""
        at32, at64 = session.row * kstore.I32_PER_ROW, session.row * kstore.I64_PER_ROW
        if grown & GREW_CONTEXT:
            session.context.buffer = kstore.get_i32(self.i32, at32 + kstore.CTX)
        if grown & GREW_TABLE:
            session.rejected.table.array = kstore.get_i64(self.i64, at64 + kstore.REJECTED_TABLE)
        if grown & GREW_TREE:
            session.tree_buffer = kstore.get_i32(self.i32, at32 + kstore.TREE)


_STATE = np.zeros(kstore.STATE_SIZE, dtype=np.int64)

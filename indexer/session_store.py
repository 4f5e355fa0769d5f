"""A namespace's sessions, by row, for compiled steps over a batch of them.

Each session keeps its arrays (:class:`~indexer.session.Session`); the store lists the same
arrays by row in numba typed lists (:mod:`indexer.kernels.store`), so one compiled call reads
and updates a batch of sessions in place, with no interpreter work per session. A session is
held from its first draft or accepted tokens until it is released (closed, or dropped by the
service); rows are reused.

The store alone knows where a session is held: the session carries no row and no reference to
any store. An array that is replaced (a context buffer, rejected table or tree buffer that
outgrew its room) is listed again the next time :meth:`SessionStore.hold` is asked for the
session's row, which every compiled step over the store does first; :meth:`SessionStore.follow`
takes up the arrays a compiled step replaced itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from indexer.kernels import store as kstore
from indexer.kernels.store import GREW_CONTEXT, GREW_TABLE, GREW_TREE
from indexer.session import Session

_EMPTY = np.zeros(0, dtype=np.int32)
_STATE = np.zeros(kstore.STATE_SIZE, dtype=np.int64)


@dataclass(slots=True)
class _Placement:
    """A held session's row and the replaceable arrays its row lists now (compared by identity
    to notice that the session replaced one)."""

    row: int
    context: np.ndarray
    table: np.ndarray
    tree: np.ndarray


class SessionStore:
    """Rows of session arrays.

    >>> from indexer.session_cache import LruTableConfig
    >>> store = SessionStore()
    >>> s = Session(np.array([1, 2, 3], dtype=np.int32), LruTableConfig(), None)
    >>> store.hold(s), s in store, store.held
    (0, True, 1)
    >>> store.release(s); s in store, store.held
    (False, 0)
    """

    def __init__(self) -> None:
        self.i32, self.i64 = kstore.new_lists()
        self._held: dict[Session, _Placement] = {}  # by identity (sessions do not define equality)
        self._free: list[int] = []

    @property
    def held(self) -> int:
        """Sessions held now."""
        return len(self._held)

    def __contains__(self, session: object) -> bool:
        return session in self._held

    def row_of(self, session: Session) -> int | None:
        """The session's row here, as last listed (``None``: not held here)."""
        placed = self._held.get(session)
        return None if placed is None else placed.row

    def hold(self, session: Session) -> int:
        """The session's row, holding it first if needed; the row lists the session's arrays
        as they are now. (A session may be held by several stores; each lists its arrays.)"""
        placed = self._held.get(session)
        if placed is None:
            return self._place(session)
        if (
            session.context.buffer is not placed.context
            or session.rejected.table.array is not placed.table
            or session.tree_buffer is not placed.tree
        ):
            self._relist(session, placed)
        return placed.row

    def release(self, session: Session) -> None:
        """Let the session's row go (the session keeps its arrays); a no-op if not held here."""
        placed = self._held.pop(session, None)
        if placed is None:
            return
        kstore.put_row(self.i32, self.i64, placed.row, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _STATE, _STATE)
        self._free.append(placed.row)

    def follow(self, session: Session, grown: int) -> None:
        """Take up the arrays a compiled step replaced for a held session: ``grown`` has bit
        :data:`GREW_CONTEXT` for its context buffer, :data:`GREW_TABLE` for its rejected table,
        :data:`GREW_TREE` for its last tree's buffer."""
        placed = self._held[session]
        at32, at64 = placed.row * kstore.I32_PER_ROW, placed.row * kstore.I64_PER_ROW
        if grown & GREW_CONTEXT:
            session.context.buffer = placed.context = kstore.get_i32(self.i32, at32 + kstore.CTX)
        if grown & GREW_TABLE:
            session.rejected.table.array = placed.table = kstore.get_i64(self.i64, at64 + kstore.REJECTED_TABLE)
        if grown & GREW_TREE:
            session.tree_buffer = placed.tree = kstore.get_i32(self.i32, at32 + kstore.TREE)

    def _place(self, session: Session) -> int:
        row = self._free.pop() if self._free else len(self._held)
        ctx, table = session.context, session.rejected.table
        sa_tokens, sa = ctx.prompt_index
        exact = _EMPTY if session.exact is None else session.exact
        kstore.put_row(
            self.i32, self.i64, row, ctx.buffer, sa_tokens, sa, exact, session.tree_buffer, session.state, table.array
        )
        self._held[session] = _Placement(row, ctx.buffer, table.array, session.tree_buffer)
        return row

    def _relist(self, session: Session, placed: _Placement) -> None:
        """List the arrays the session replaced since its row last listed them (grown in Python)."""
        at32, at64 = placed.row * kstore.I32_PER_ROW, placed.row * kstore.I64_PER_ROW
        if session.context.buffer is not placed.context:
            placed.context = session.context.buffer
            kstore.put_i32(self.i32, at32 + kstore.CTX, placed.context)
        if session.rejected.table.array is not placed.table:
            placed.table = session.rejected.table.array
            kstore.put_i64(self.i64, at64 + kstore.REJECTED_TABLE, placed.table)
        if session.tree_buffer is not placed.tree:
            placed.tree = session.tree_buffer
            kstore.put_i32(self.i32, at32 + kstore.TREE, placed.tree)

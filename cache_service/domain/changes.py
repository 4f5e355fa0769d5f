"""Write-behind change tracking: which sessions changed since storage last took them, and what
to write for each (the whole session, or what it gained since).

Everything here runs on the thread that serves calls (a snapshot must not race a draft); the
writing itself happens elsewhere, from what :meth:`ChangeTracker.take` hands over.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache_service.domain.errors import NotFound
from cache_service.domain.sessions import SessionEntry, SessionTable
from cache_service.storage.stored_session import StoredSession
from indexer.session_cache import TableColumns


@dataclass(frozen=True)
class SessionDelta:
    """What a session gained since storage last took it: ``tokens`` to append after the
    ``held`` context tokens storage has, and its whole rejected table when that is due."""

    held: int
    tokens: np.ndarray
    rejected: TableColumns | None = None


SessionChange = StoredSession | SessionDelta
Changes = tuple[list[tuple[str, SessionChange]], list[str]]  # (changed sessions, ids closed)


@dataclass(frozen=True)
class Saved:
    """What a write-back of :class:`Changes` did: sessions whose delta did not apply (storage
    lost the context it extends: write them whole next time), whole sessions written, and
    whole sessions refused because storage holds another tenant's session under the id (one a
    replica opened without checking, storage being down then: it ends here)."""

    missed: list[str]
    written: list[str]
    refused: list[str]


ENDED_KEEP_S = 60.0  # a closed session's stored copy is deleted by a write-back well within this


class ChangeTracker:
    """The sessions of a :class:`SessionTable` changed since storage last took them, and the
    ids closed since. A rejected table is written at most every ``table_flush_interval_s``.
    Of the ids closed, the latest ``max_closed`` are kept while storage does not take them
    (an outage would otherwise grow them with every close): a stored copy not deleted expires
    with the session TTL all the same."""

    def __init__(self, sessions: SessionTable, table_flush_interval_s: float, *, max_closed: int) -> None:
        self._sessions = sessions
        self._table_interval = table_flush_interval_s
        self._dirty: set[str] = set()  # sessions changed since storage last saw them
        self._round: list[str] = []  # dirty sessions a round with a budget has still to look at
        self._closed: dict[str, None] = {}  # ids closed since, oldest first
        self._max_closed = max_closed
        # ids closed here -> when, oldest first: their stored copies, until a write-back deletes
        # them, are not continued (a closed session does not come back from storage)
        self._ended: dict[str, float] = {}

    def changed(self, sids: Iterable[str]) -> None:
        self._dirty.update(sids)

    def closed(self, entry: SessionEntry) -> bool:
        """The session ended: its stored copy is deleted at the next write-back, unless it was
        opened unchecked and never written back (its id may be another tenant's). Whether its
        stored copy is to be deleted."""
        self._dirty.discard(entry.sid)
        if entry.unchecked:
            return False
        self._closed[entry.sid] = None
        self._keep_latest(self._closed)
        self._ended.pop(entry.sid, None)
        self._ended[entry.sid] = time.monotonic()
        self._keep_latest(self._ended)
        return True

    def ended_lately(self, sid: str) -> bool:
        """Whether the session was closed here within :data:`ENDED_KEEP_S`: what storage may
        still keep of it (the write-back that deletes it not run yet) is not to be continued."""
        since = self._ended.get(sid)
        if since is None:
            return False
        if time.monotonic() - since < ENDED_KEEP_S:
            return True
        del self._ended[sid]
        return False

    def _keep_latest(self, ids: dict[str, Any]) -> None:
        """``ids`` (oldest first) cut to the latest ``max_closed``."""
        while len(ids) > self._max_closed:
            del ids[next(iter(ids))]

    def pending(self, sid: str) -> bool:
        """Whether the session has changes storage has not taken (it must not leave memory)."""
        return sid in self._dirty

    def __len__(self) -> int:
        return len(self._dirty)

    @property
    def taking(self) -> bool:
        """Whether a round of :meth:`take` with a budget has sessions left to look at."""
        return bool(self._round)

    def take(self, *, final: bool = False, budget_s: float | None = None) -> Changes:
        """Changes of sessions since storage last took them, and ids closed since.

        A session storage does not hold yet (or holds a different context of) is taken whole;
        one it holds gives only its new tokens, plus its rejected table when that changed and
        the table interval passed since it was last written (always when ``final``). A table
        change not due yet keeps the session pending (it does not leave memory either).

        With ``budget_s``, a call stops looking at sessions once that long has passed (after
        one at least), so the calls it serves wait that long at most; :attr:`taking` says
        whether the sessions changed when the round began are all taken.
        """
        began = now = time.monotonic()
        if budget_s is None:
            todo, self._round = list(self._dirty), []
        else:
            if not self._round:
                self._round = list(self._dirty)
            todo = self._round
        changed: list[tuple[str, SessionChange]] = []
        done = 0
        for sid in todo:
            if budget_s is not None and done and time.monotonic() - began >= budget_s:
                break
            done += 1
            if sid not in self._dirty:
                continue  # closed, or taken by a call without a budget, since the round began
            self._dirty.discard(sid)
            try:
                entry = self._sessions.get(sid)
            except NotFound:
                continue  # expired meanwhile
            change = self._take_one(entry, now, final)
            if change is not None:
                changed.append((sid, change))
        if budget_s is not None:
            del self._round[:done]
        closed = list(self._closed)
        self._closed.clear()
        return changed, closed

    def _take_one(self, entry: SessionEntry, now: float, final: bool) -> SessionChange | None:
        """What to write of one changed session (``None``: nothing yet), marked as taken."""
        session = entry.session
        size = len(session.context)
        table = session.rejected.table
        table_changed = table.version != entry.stored_table
        table_due = table_changed and (final or now - entry.table_saved_at >= self._table_interval)
        change: SessionChange | None = None
        if not 0 < entry.stored_tokens <= size:
            change = StoredSession(entry.namespace, session.snapshot(), entry.params, entry.tenant)
            table_changed = table_due = True
        elif size > entry.stored_tokens or table_due:
            new = session.context.tokens[entry.stored_tokens :].copy()
            change = SessionDelta(entry.stored_tokens, new, table.columns() if table_due else None)
        entry.stored_tokens = size
        if table_due:
            entry.stored_table, entry.table_saved_at = table.version, now
        elif table_changed:
            self._dirty.add(entry.sid)  # pending: looked at again next round
        return change

    def requeue(self, sids: Iterable[str], closed: Iterable[str] = ()) -> None:
        """Put back changes storage could not take: the sessions are written whole next time,
        as what storage holds of them is unknown."""
        for sid in sids:
            try:
                entry = self._sessions.get(sid)
            except NotFound:
                continue
            entry.stored_tokens, entry.stored_table = 0, -1
            self._dirty.add(sid)
        self._closed = dict.fromkeys([*closed, *self._closed])  # closed before those since
        self._keep_latest(self._closed)

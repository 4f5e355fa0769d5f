"""Continuing sessions from storage: ones another replica opened (or this one held before a
restart, or let leave memory for room).

Sessions a call names are read from storage before the call needs them, so that the reading
can happen off the thread that serves calls (see the servicer): a slow or unreachable storage
then delays only the calls that name such sessions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from cache_service.domain import names
from cache_service.domain.errors import InvalidArgument, NotFound, unknown_session
from cache_service.domain.namespaces import Namespaces
from cache_service.domain.sessions import SessionEntry, SessionTable
from cache_service.domain.tenants import Principal, owns
from cache_service.storage.stored_session import StoredSession
from indexer.session import Session

logger = logging.getLogger(__name__)

Found = dict[str, tuple[StoredSession, Session | None]]  # per id: as stored, and built from it
Load = Callable[[str], StoredSession | None]


class Continuing:
    """Reads sessions from storage (``load``) and holds them in memory again; ``make_room``
    frees session memory for the tokens a session brings back. A session ``ended`` says this
    replica closed lately is never continued: storage may keep its copy until the next
    write-back deletes it, and a closed session does not come back."""

    def __init__(
        self,
        load: Load,
        namespaces: Namespaces,
        sessions: SessionTable,
        make_room: Callable[[int], None],
        ended: Callable[[str], bool],
    ) -> None:
        self._load = load
        self._namespaces = namespaces
        self._sessions = sessions
        self._make_room = make_room
        self._ended = ended

    def load(self, sid: str) -> StoredSession | None:
        """What storage keeps of ``sid`` (``None`` for one closed here lately, unread); an id no
        storage key could hold is refused."""
        names.session_id(sid)
        return None if self._ended(sid) else self._load(sid)

    def read(self, sids: Sequence[str], *, build: bool = True) -> Found:
        """What storage keeps of ``sids`` (those it has), each with the session built from it
        (its prompt indexed; without ``build``, ``None``); safe on any thread, as it changes
        nothing held in memory. Every id is checked before storage is asked for any."""
        for sid in sids:
            names.session_id(sid)
        found = {sid: self._load(sid) for sid in sids}
        return {
            sid: (stored, self._resumed(stored) if build else None)
            for sid, stored in found.items()
            if stored is not None
        }

    def _resumed(self, stored: StoredSession) -> Session | None:
        """The session ``stored`` continues, or ``None`` when it cannot be built here (an unknown
        namespace, a snapshot that does not fit it): :meth:`hold` then reports that on the
        serving thread, after checking the caller may know of it."""
        try:
            return self._namespaces.get(stored.namespace).resume(stored.snapshot)
        except (NotFound, ValueError):
            return None

    def hold_found(self, found: Found, principal: Principal | None) -> None:
        """Hold sessions :meth:`read` found (on the serving thread); one that came back
        meanwhile, one closed here lately, or one that is not the caller's (another tenant's, or
        in a namespace it may not use), is left alone (the call then answers for it as it would
        have)."""
        for sid, (stored, session) in found.items():
            if self._sessions.holds(sid) or self._ended(sid) or not owns(principal, stored.tenant, stored.namespace):
                continue
            self.hold(sid, stored, principal, session)

    def hold(
        self, sid: str, stored: StoredSession, principal: Principal | None, session: Session | None = None
    ) -> SessionEntry:
        """A session held in memory again from what storage kept of it (``session``: already
        built from it by :meth:`read`). Another tenant's session is reported as unknown, as
        for a live one: its existence is not disclosed, and it stays as stored."""
        if not owns(principal, stored.tenant, stored.namespace):
            raise unknown_session(sid)
        drafter = self._namespaces.get(stored.namespace)
        if session is None:
            try:
                session = drafter.resume(stored.snapshot)
            except ValueError as exc:  # a stored context outside the namespace's vocabulary
                raise InvalidArgument(f"session {sid!r} cannot continue here: {exc}") from exc
        entry = SessionEntry(sid, stored.namespace, drafter, session, stored.params, stored.tenant)
        entry.stored_tokens = len(entry.session.context)  # storage holds what it was continued from
        entry.stored_table, entry.table_saved_at = entry.session.rejected.table.version, time.monotonic()
        self._make_room(len(entry.session.context))
        self._sessions.add(entry)
        logger.info("session %s continued from storage", sid)
        return entry

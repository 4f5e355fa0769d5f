"""Live sessions of one service process: unguessable ids, idle expiry, a global limit."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cache_service.domain.errors import ResourceExhausted, unknown_session
from indexer.drafter import DraftParams, NamespaceDrafter, Session


@dataclass
class SessionEntry:
    """A session and what serving it needs."""

    sid: str
    namespace: str
    drafter: NamespaceDrafter
    session: Session
    params: DraftParams
    tenant: str = ""  # who opened it ("" when callers are not authenticated)
    # Opened under a client-chosen id while storage could not say whether another tenant's
    # session holds it: until a write-back lands the session, a close deletes no stored copy.
    unchecked: bool = False
    last_used: float = field(default_factory=time.monotonic)
    counted: int = 0  # context tokens this entry adds to the table's total
    # What storage holds of the session, as far as the last write-back went: context tokens
    # (0: nothing, the next write is whole), and the rejected table's version and when.
    stored_tokens: int = 0
    stored_table: int = -1
    table_saved_at: float = 0.0


def new_session_id() -> str:
    """128 random bits as hex: not guessable, not enumerable, safe inside any storage key."""
    return secrets.token_hex(16)


class SessionTable:
    """Sessions by id, least recently used first.

    >>> table = SessionTable(max_sessions=1, ttl_s=60)
    >>> table.get("nope")
    Traceback (most recent call last):
    ...
    cache_service.domain.errors.NotFound: unknown or expired session 'nope'
    """

    def __init__(self, *, max_sessions: int, ttl_s: float) -> None:
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._max = max_sessions
        self._ttl = ttl_s
        self.tokens = 0  # context tokens held by all sessions
        self._tenant_tokens: dict[str, int] = {}  # those held by each tenant's sessions
        self.evicted = 0  # sessions made to leave memory for room

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: SessionEntry) -> None:
        self.room(1)
        self._entries[entry.sid] = entry
        self.grow(entry, len(entry.session.context))

    def room(self, sessions: int) -> None:
        """``ResourceExhausted`` unless ``sessions`` more fit under the session limit (expired
        sessions leave first)."""
        self.expire()
        if len(self._entries) + sessions > self._max:
            raise ResourceExhausted(
                f"{len(self._entries)} sessions held; {sessions} more exceed the session limit of {self._max} "
                "(close or let sessions expire)"
            )

    def grow(self, entry: SessionEntry, tokens: int) -> None:
        entry.counted += tokens
        self.tokens += tokens
        self._tenant_tokens[entry.tenant] = self._tenant_tokens.get(entry.tenant, 0) + tokens

    def tenant_tokens(self, tenant: str) -> int:
        """The context tokens the tenant's sessions hold (kept as they change: no scan)."""
        return self._tenant_tokens.get(tenant, 0)

    def make_room(self, tokens: int, limit: int, evictable: Callable[[str], bool]) -> bool:
        """Evict least recently used sessions that ``evictable`` allows until ``tokens`` more
        fit under ``limit``; whether they now fit."""
        for sid in [sid for sid in self._entries if evictable(sid)]:
            if self.tokens + tokens <= limit:
                break
            self._drop(sid)
            self.evicted += 1
        return self.tokens + tokens <= limit

    def _drop(self, sid: str) -> SessionEntry:
        entry = self._entries.pop(sid)
        self.tokens -= entry.counted
        left = self._tenant_tokens[entry.tenant] - entry.counted
        if left:
            self._tenant_tokens[entry.tenant] = left
        else:
            del self._tenant_tokens[entry.tenant]
        entry.drafter.release(entry.session)  # its arrays leave the drafter's store
        return entry

    def get(self, sid: str) -> SessionEntry:
        entry = self._live(sid)
        if entry is None:
            raise unknown_session(sid)
        return entry

    def find(self, sid: str) -> SessionEntry | None:
        """The session if held, idle past the TTL or not."""
        return self._entries.get(sid)

    def holds(self, sid: str) -> bool:
        """Whether :meth:`get` would return the session."""
        return self._live(sid) is not None

    def _live(self, sid: str) -> SessionEntry | None:
        """The session, unless unknown or idle past the TTL."""
        entry = self._entries.get(sid)
        return entry if entry is not None and time.monotonic() - entry.last_used <= self._ttl else None

    def touch(self, entry: SessionEntry) -> None:
        self.touch_many([entry])

    def touch_many(self, entries: Sequence[SessionEntry]) -> None:
        """The sessions used now, in order (the last one is the most recently used)."""
        now = time.monotonic()
        move = self._entries.move_to_end
        for entry in entries:
            entry.last_used = now
            move(entry.sid)

    def pop(self, sid: str) -> SessionEntry:
        self.get(sid)
        return self._drop(sid)

    def discard(self, sid: str) -> bool:
        """Drop the session, expired or not; whether it was held."""
        if sid not in self._entries:
            return False
        self._drop(sid)
        return True

    def expire(self, most: int | None = None) -> list[str]:
        """Drop sessions idle past the TTL (the ``most`` idlest of them, when given); their ids."""
        now, gone = time.monotonic(), list[str]()
        while self._entries and (most is None or len(gone) < most):
            sid, entry = next(iter(self._entries.items()))
            if now - entry.last_used <= self._ttl:
                break
            self._drop(sid)
            gone.append(sid)
        return gone

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """Sessions a tenant holds and the context tokens in them."""
        mine = [e for e in self._entries.values() if e.tenant == tenant]
        return len(mine), self.tenant_tokens(tenant)

    def entries_where(self, keep: Callable[[SessionEntry], bool]) -> list[SessionEntry]:
        """The sessions held (expired ones included) for which ``keep`` holds."""
        return [entry for entry in self._entries.values() if keep(entry)]

    def count_by_namespace(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for entry in self._entries.values():
            out[entry.namespace] = out.get(entry.namespace, 0) + 1
        return out

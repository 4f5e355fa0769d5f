"""Admission: the limits a call must fit before it changes anything (batch size, tokens per
call, prompt size, a tenant's own limits, the session memory). The transport checks a request's
sizes here before it builds anything from it (see :mod:`cache_service.rpc.servicer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cache_service.config import ServiceConfig
from cache_service.domain.errors import InvalidArgument, ResourceExhausted
from cache_service.domain.items import Opening
from cache_service.domain.sessions import SessionTable
from cache_service.domain.tenants import Principal
from indexer.drafter import MAX_BUDGET, MAX_DEPTH

# Rejected branches a feedback call may name. A decoder reports those of the tree it verified:
# no tree has more than MAX_BUDGET nodes to leave its accepted path, nor a path longer than
# MAX_DEPTH. A call holds the branches of 16 of the largest trees, or of a full batch of 256
# default trees (64 nodes): at ~3.5 us a branch, the serving loop is held about 0.1 s at most.
MAX_ITEM_BRANCHES = MAX_BUDGET
MAX_CALL_BRANCHES = 16 * MAX_BUDGET
MAX_BRANCH_TOKENS = MAX_DEPTH


class Admission:
    """Checks a call against the service's limits. ``may_leave(sid)`` says whether a session
    may leave memory to make room (one whose changes storage has not taken may not)."""

    def __init__(self, config: ServiceConfig, sessions: SessionTable, may_leave: Callable[[str], bool]) -> None:
        self._config = config
        self._sessions = sessions
        self._may_leave = may_leave

    def batch(self, size: int) -> None:
        if size > self._config.max_batch:
            raise ResourceExhausted(f"batch of {size} exceeds the limit of {self._config.max_batch}")

    def columns(self, sessions: int, counts: int, lookahead: int, tokens: int) -> None:
        """A columnar draft's sizes, from the lengths of its columns alone (before any array is
        built from them): the batch, one count (and one lookahead, when sent) per session, and
        no more new tokens than the sessions may bring."""
        self.batch(sessions)
        if counts != sessions:
            raise InvalidArgument(f"{counts} new-token counts for {sessions} sessions")
        if lookahead not in (0, sessions):
            raise InvalidArgument(f"{lookahead} lookahead values for {sessions} sessions")
        if tokens and not sessions:
            raise InvalidArgument(f"{tokens} new tokens for no session")
        if tokens > sessions * self._config.max_new_tokens:
            raise ResourceExhausted(
                f"{tokens} new tokens for {sessions} sessions exceed {self._config.max_new_tokens} per session"
            )

    def new_tokens(self, count: int) -> None:
        """The most new tokens one session may bring in one call."""
        if count > self._config.max_new_tokens:
            raise ResourceExhausted(f"{count} new tokens in one call exceed {self._config.max_new_tokens}")

    def topk_rows(self, rows: int, sessions: int = 1) -> None:
        """The most top-k rows ``sessions`` may bring in one call: a row per verified position,
        as many as the new tokens they may bring."""
        if rows > sessions * self._config.max_new_tokens:
            raise ResourceExhausted(
                f"{rows} top-k rows for {sessions} sessions exceed {self._config.max_new_tokens} per session"
            )

    def branches(self, counts: Sequence[int], longest: Callable[[], int]) -> None:
        """The rejected branches a feedback call names, ``counts`` per item: at most
        :data:`MAX_ITEM_BRANCHES` an item and :data:`MAX_CALL_BRANCHES` in all, then (asked only
        once those fit) the ``longest`` at most :data:`MAX_BRANCH_TOKENS` tokens.

        >>> admission = Admission(ServiceConfig(), SessionTable(max_sessions=1, ttl_s=60), bool)
        >>> admission.branches([2, 0], lambda: 3)
        >>> admission.branches([MAX_ITEM_BRANCHES + 1], lambda: 3)
        Traceback (most recent call last):
        ...
        cache_service.domain.errors.ResourceExhausted: 1025 rejected branches in one item exceed 1024
        """
        most, total = max(counts, default=0), sum(counts)
        if most > MAX_ITEM_BRANCHES:
            raise ResourceExhausted(f"{most} rejected branches in one item exceed {MAX_ITEM_BRANCHES}")
        if total > MAX_CALL_BRANCHES:
            raise ResourceExhausted(f"{total} rejected branches in one call exceed {MAX_CALL_BRANCHES}")
        if total and (size := longest()) > MAX_BRANCH_TOKENS:
            raise ResourceExhausted(f"a rejected branch of {size} tokens exceeds {MAX_BRANCH_TOKENS}")

    def prompt(self, size: int) -> None:
        if size > self._config.max_prompt_tokens:
            raise ResourceExhausted(f"prompt of {size} tokens exceeds {self._config.max_prompt_tokens}")

    def room_for(self, opening: Opening, keep: list[bool] | None = None) -> None:
        """The service's session limit, the tenant's limits and the session memory, for the
        sessions ``opening`` adds (those ``keep`` marks, all by default): the whole batch fits,
        or none of it is opened."""
        prompts = [p for j, (_, _, p) in enumerate(opening.prepared) if p is not None and (keep is None or keep[j])]
        self._sessions.room(len(prompts))
        if opening.principal is not None:
            self.tenant(opening.principal, len(prompts), sum(p.size for p in prompts))
        self.make_room(sum(p.size for p in prompts))

    def make_room(self, tokens: int) -> None:
        """Keep sessions' context tokens in memory under the limit: the least recently used
        sessions that may leave memory do (a later call continues them from storage, or,
        without storage, their clients re-open them)."""
        limit = self._config.max_session_tokens
        if tokens > limit:
            raise ResourceExhausted(f"{tokens} prompt tokens exceed the session memory of {limit} tokens")
        if self._sessions.tokens + tokens <= limit:
            return
        self._sessions.expire()
        if not self._sessions.make_room(tokens, limit, self._may_leave):
            held = self._sessions.tokens
            raise ResourceExhausted(
                f"sessions hold {held} tokens; {tokens} more exceed {limit} (none can leave memory yet)"
            )

    def tenant_growth(self, principal: Principal | None, tokens: int) -> None:
        """The caller's sessions taking ``tokens`` more (drafts' new tokens, feedback's accepted
        ones): ``ResourceExhausted``, before any is taken, past the tenant's token limit."""
        limit = 0 if principal is None else principal.limits.max_session_tokens
        if not limit or not tokens:
            return
        assert principal is not None
        held = self._sessions.tenant_tokens(principal.tenant)
        if held + tokens > limit:
            self._sessions.expire()
            held = self._sessions.tenant_tokens(principal.tenant)
        if held + tokens > limit:
            raise ResourceExhausted(
                f"tenant {principal.tenant!r} sessions hold {held} tokens; {tokens} more exceed its limit of {limit}"
            )

    def tenant(self, principal: Principal, sessions: int, tokens: int) -> None:
        """The tenant's own limits (sessions, context tokens held) with ``sessions`` more."""
        limits = principal.limits
        if not limits.max_sessions and not limits.max_session_tokens:
            return
        self._sessions.expire()
        held, held_tokens = self._sessions.tenant_usage(principal.tenant)
        if limits.max_sessions and held + sessions > limits.max_sessions:
            raise ResourceExhausted(
                f"tenant {principal.tenant!r} holds {held} sessions; its limit is {limits.max_sessions}"
            )
        if limits.max_session_tokens and held_tokens + tokens > limits.max_session_tokens:
            raise ResourceExhausted(
                f"tenant {principal.tenant!r} sessions hold {held_tokens} tokens; its limit is "
                f"{limits.max_session_tokens}"
            )

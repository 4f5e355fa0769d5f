"""Ended requests whose commit has not reached the service yet.

A request's tokens feed the fleet's lifetime memory only when its close with commit lands. A
close that fails (the service down, restarting, or past the control timeout), or a request that
ends while its server copy is lost, would drop them: the backlog keeps their tokens instead,
and the client commits them once the service answers again (a background open of the whole
sequence, then a close with commit). Delivery is at least once: a close that timed out may have
landed, and its request is then committed twice, which costs the log a repeat and loses nothing.

The backlog is bounded in tokens; past the bound the oldest requests go first (counted).

>>> backlog = CommitBacklog(max_tokens=5)
>>> backlog.keep([1, 2, 3])  # server ids of dropped requests' open copies: none
[]
>>> _ = backlog.keep([4, 5, 6])  # 6 tokens: the oldest request is dropped
>>> len(backlog), backlog.dropped
(1, 1)
>>> [s.tokens() for s in backlog.to_open()]
[[4, 5, 6]]
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence

import grpc

from decoder_client.client.session import ClientSession

logger = logging.getLogger(__name__)

# A call that failed with one of these will fail the same way again: its requests are dropped.
REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


def worth_retrying(exc: BaseException | None) -> bool:
    """Whether a call that ended with ``exc`` may land if sent again (a timeout, the service
    down or busy), rather than being refused for what it carries."""
    return not (isinstance(exc, grpc.RpcError) and exc.code() in REFUSED)


class CommitBacklog:
    """Requests to commit once the service answers, at most ``max_tokens`` tokens in all, and
    the commits under way (by server session id) until their close is booked."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._waiting: deque[ClientSession] = deque()
        self._tokens = 0
        self._sent: dict[str, list[int]] = {}  # server id -> tokens, while its close is under way
        self.dropped = 0  # requests dropped for the bound: never committed
        self.kept = 0  # requests kept here at some point (their first commit did not land)

    def __len__(self) -> int:
        return len(self._waiting)

    def keep(self, tokens: list[int], *, retry: bool = True) -> list[str]:
        """Commit ``tokens`` (a whole request, prompt included) later (``retry``: its first
        commit did not land; False: the first one goes this way). Returns the server ids of
        requests dropped for the bound while their copy was open (to close without commit)."""
        self.kept += retry
        self._waiting.append(ClientSession(tokens, len(tokens)))
        self._tokens += len(tokens)
        opened = []
        while self._tokens > self.max_tokens and self._waiting:
            old = self._waiting.popleft()
            self._tokens -= len(old)
            self.dropped += 1
            if old.server_id:
                opened.append(old.server_id)
            logger.warning("commit backlog over %d tokens: a %d-token request is dropped", self.max_tokens, len(old))
        return opened

    def to_open(self, most: int | None = None) -> list[ClientSession]:
        """The waiting requests without a server copy (to open with their whole sequence): the
        oldest ``most`` of them (None: all)."""
        unopened = (s for s in self._waiting if not s.server_id)
        return list(unopened if most is None else itertools.islice(unopened, max(0, most)))

    def ready(self) -> list[ClientSession]:
        """The waiting requests that have a server copy now, taken out (their close is next)."""
        ready = [s for s in self._waiting if s.server_id]
        if ready:
            self._waiting = deque(s for s in self._waiting if not s.server_id)
            self._tokens -= sum(map(len, ready))
        return ready

    def discard(self, sessions: Sequence[ClientSession]) -> None:
        """Give up on those of ``sessions`` waiting here (the service refused them)."""
        gone = {id(s) for s in sessions}
        kept = deque(s for s in self._waiting if id(s) not in gone)
        dropped = len(self._waiting) - len(kept)
        if dropped:
            logger.warning("the service refused %d ended requests: they are not committed", dropped)
            self.dropped += dropped
            self._waiting = kept
            self._tokens = sum(map(len, kept))

    def sending(self, server_id: str, tokens: list[int]) -> None:
        """A close with commit of ``tokens`` under way on ``server_id``."""
        self._sent[server_id] = tokens

    def settled(self, server_ids: Sequence[str], exc: BaseException | None) -> list[str]:
        """Book the closes of ``server_ids``, which ended with ``exc`` (None: they landed).
        Those that failed are kept to commit again, unless the service refused them. Returns
        the server ids to close without commit (see :meth:`keep`)."""
        opened: list[str] = []
        for sid in server_ids:
            tokens = self._sent.pop(sid, None)
            if tokens is None or exc is None:
                continue
            if worth_retrying(exc):
                opened += self.keep(tokens)
            else:
                self.dropped += 1
                logger.warning("the service refused a commit (%s): the request is not committed", exc)
        return opened

    @property
    def unsent(self) -> int:
        """Requests not committed yet: waiting, or with their close under way."""
        return len(self._waiting) + len(self._sent)

"""Ended requests whose commit has not reached the service yet.

A request's tokens feed the fleet's lifetime memory only when its close with commit lands. A
close that fails (the service down, restarting, or past the control timeout), or a request that
ends while its server copy is lost, would drop them: the backlog keeps their tokens instead,
and the client commits them once the service answers again (a background open of the whole
sequence, then a close with commit). A close that failed may have landed all the same (its
answer lost, or late): each request's commit is named by a key made when it ends
(:func:`commit_key`), sent with its first close with commit and with every retry, and the
service appends a commit whose key its log recorded lately no more (it answers OK: the first
landed). So a request reaches the lifetime log once, however many times it is sent, within the
service's window (24 h, and its namespace's last 131,072 keys).

The backlog is bounded in tokens; past the bound the oldest requests go first (counted).

>>> backlog = CommitBacklog(max_tokens=5)
>>> backlog.keep([1, 2, 3])  # server ids of dropped requests' open copies: none
[]
>>> _ = backlog.keep([4, 5, 6])  # 6 tokens: the oldest request is dropped
>>> len(backlog), backlog.dropped
(1, 1)
>>> [s.tokens() for s in backlog.to_open()]
[[4, 5, 6]]
>>> backlog.sending("sid", [7, 8], "k" * 32)  # a close with commit under way ...
>>> _ = backlog.settled(["sid"], TimeoutError())  # ... failed: kept, with its key
>>> backlog.to_open()[-1].commit_key == "k" * 32
True
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence
from secrets import token_hex

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


def commit_key() -> str:
    """A new request's commit key: random, 32 hex digits (the service takes 16-64 characters)."""
    return token_hex(16)


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
        self._sent: dict[str, tuple[list[int], str]] = {}  # server id -> (tokens, key), while its close is under way
        self.dropped = 0  # requests dropped for the bound: never committed
        self.kept = 0  # requests kept here at some point (their first commit did not land)

    def __len__(self) -> int:
        return len(self._waiting)

    def keep(self, tokens: list[int], key: str = "", *, retry: bool = True) -> list[str]:
        """Commit ``tokens`` (a whole request, prompt included) later, under ``key`` (its
        commit's key; "": a new one), (``retry``: its first commit did not land; False: the
        first one goes this way). Returns the server ids of requests dropped for the bound while
        their copy was open (to close without commit)."""
        self.kept += retry
        kept = ClientSession(tokens, len(tokens))
        kept.commit_key = key or commit_key()
        self._waiting.append(kept)
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

    def sending(self, server_id: str, tokens: list[int], key: str) -> None:
        """A close with commit of ``tokens``, under ``key``, under way on ``server_id``."""
        self._sent[server_id] = (tokens, key)

    def settled(self, server_ids: Sequence[str], exc: BaseException | None) -> list[str]:
        """Book the closes of ``server_ids``, which ended with ``exc`` (None: they landed).
        Those that failed are kept to commit again, unless the service refused them. Returns
        the server ids to close without commit (see :meth:`keep`)."""
        opened: list[str] = []
        for sid in server_ids:
            sent = self._sent.pop(sid, None)
            if sent is None or exc is None:
                continue
            if worth_retrying(exc):
                opened += self.keep(*sent)
            else:
                self.dropped += 1
                logger.warning("the service refused a commit (%s): the request is not committed", exc)
        return opened

    @property
    def unsent(self) -> int:
        """Requests not committed yet: waiting, or with their close under way."""
        return len(self._waiting) + len(self._sent)

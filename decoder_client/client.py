"""``DraftClient``: what an inference server embeds to get draft trees from draftcache.

One batched call per decode step serves the whole batch; each session sends only the tokens
produced since its previous call. Every call has a deadline (a few milliseconds by default): if
the service is slow or down, the client answers from a local fallback drafter (prompt lookup
over the session's own context) instead, so decoding never waits on the cache. A session whose
server copy may have missed tokens (a call that failed midway) is re-opened with its full
context the next time the service answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from indexer.drafter import DraftParams
from indexer.prompt_lookup import prompt_lookup
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)

Fallback = Callable[[np.ndarray, int], DraftTree]
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def prompt_lookup_fallback(context: np.ndarray, budget: int) -> DraftTree:
    """The local drafter: a prompt-lookup chain of at most ``budget`` tokens."""
    return DraftTree.chain(prompt_lookup(context, num_tokens=max(0, min(budget, 10))))


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    target: str
    namespace: str
    params: DraftParams = field(default_factory=DraftParams)
    deadline_s: float = 0.005  # per draft call; past it the fallback answers
    control_timeout_s: float = 1.0  # open / close calls
    retry_after_s: float = 0.5  # after a failure, skip the service this long

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.control_timeout_s <= 0 or self.retry_after_s < 0:
            raise ValueError("deadlines must be > 0 and retry_after_s >= 0")


@dataclass
class ClientSession:
    """The client's view of one request: its full context and its server session, if any."""

    context: np.ndarray
    prompt_len: int
    server_id: str = ""  # "" while the service has no valid copy
    pending: list[int] = field(default_factory=list)  # produced since the last successful call


@dataclass
class ClientStats:
    remote: int = 0  # trees that came from the service
    fallback: int = 0  # trees the local drafter made
    failures: int = 0  # calls that failed or missed their deadline
    reopened: int = 0


class DraftClient:
    """Sync client; see the module docstring.

    >>> client = DraftClient(ClientConfig(target="127.0.0.1:50051", namespace="llama2"))  # doctest: +SKIP
    >>> sessions = client.open([[1, 2, 3]])  # doctest: +SKIP
    >>> trees = client.draft(sessions, [[]])  # doctest: +SKIP
    """

    def __init__(self, config: ClientConfig, fallback: Fallback = prompt_lookup_fallback) -> None:
        self.config = config
        self.stats = ClientStats()
        self._fallback = fallback
        # Reconnect quickly after an outage: the fallback covers the gap, not a long backoff.
        self._channel = grpc.insecure_channel(config.target, options=RECONNECT_OPTIONS)
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._down_until = 0.0
        self._params = pb.DraftParams(
            budget=config.params.budget,
            max_depth=config.params.max_depth,
            min_score=config.params.min_score,
            depth_reserve=config.params.depth_reserve,
        )

    def open(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[ClientSession]:
        sessions = [ClientSession(np.asarray(p, dtype=np.int32), len(p)) for p in prompts]
        self._reopen(sessions)
        return sessions

    def draft(self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]) -> list[DraftTree]:
        """Append each session's new tokens, then one tree per session (remote or fallback)."""
        for s, new in zip(sessions, new_tokens, strict=True):
            if len(new):
                s.context = np.concatenate((s.context, np.asarray(new, dtype=np.int32)))
                s.pending.extend(int(t) for t in new)
        self._reopen([s for s in sessions if not s.server_id])
        remote = [s for s in sessions if s.server_id]
        trees = self._remote_draft(remote) if remote and self._available() else None
        if trees is None:
            for s in remote:
                s.server_id = ""  # it may have missed tokens: re-open with the full context later
            self.stats.fallback += len(sessions)
            return [self._fallback(s.context, self.config.params.budget) for s in sessions]
        by_session = dict(zip((id(s) for s in remote), trees, strict=True))
        out = []
        for s in sessions:
            tree = by_session.get(id(s))
            if tree is None:
                self.stats.fallback += 1
                tree = self._fallback(s.context, self.config.params.budget)
            out.append(tree)
        return out

    def close(self, sessions: Sequence[ClientSession], *, commit: bool = True) -> None:
        """End the requests; with ``commit`` the service adds them to its lifetime memory."""
        live = [s for s in sessions if s.server_id and self._available()]
        if not live:
            return
        items = []
        for s in live:
            if s.pending:  # the last step's tokens belong to the request
                self._call(
                    self._stub.Feedback,
                    pb.FeedbackRequest(items=[pb.FeedbackItem(session_id=s.server_id, accepted=s.pending)]),
                    self.config.control_timeout_s,
                )
                s.pending = []
            items.append(pb.CloseSession(session_id=s.server_id, commit=commit))
        self._call(self._stub.CloseSessions, pb.CloseSessionsRequest(sessions=items), self.config.control_timeout_s)

    def shutdown(self) -> None:
        self._channel.close()

    # -- internals ---------------------------------------------------------------------------

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, method: Callable, request: object, timeout: float) -> object | None:
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            self.stats.failures += 1
            self._down_until = time.monotonic() + self.config.retry_after_s
            logger.debug("draftcache call failed (%s); local drafts for %.1f s", exc.code(), self.config.retry_after_s)
            return None

    def _reopen(self, sessions: list[ClientSession]) -> None:
        if not sessions or not self._available():
            return
        req = pb.OpenSessionsRequest(
            sessions=[
                pb.OpenSession(namespace=self.config.namespace, prompt=s.context.tolist(), params=self._params)
                for s in sessions
            ]
        )
        resp = self._call(self._stub.OpenSessions, req, self.config.control_timeout_s)
        if resp is None:
            return
        for s, sid in zip(sessions, resp.session_ids, strict=True):  # type: ignore[attr-defined]
            if s.prompt_len != s.context.size:
                self.stats.reopened += 1
            s.server_id, s.pending = sid, []

    def _remote_draft(self, sessions: list[ClientSession]) -> list[DraftTree] | None:
        req = pb.DraftRequest(items=[pb.DraftItem(session_id=s.server_id, new_tokens=s.pending) for s in sessions])
        resp = self._call(self._stub.Draft, req, self.config.deadline_s)
        if resp is None:
            return None
        for s in sessions:
            s.pending = []
        self.stats.remote += len(sessions)
        return [tree_from_proto(t) for t in resp.trees]  # type: ignore[attr-defined]


def tree_from_proto(msg: pb.Tree) -> DraftTree:
    """A wire tree as the domain type."""
    return DraftTree(
        np.array(msg.tokens, dtype=np.int32),
        np.array(msg.parents, dtype=np.int32),
        np.frombuffer(msg.sources, dtype=np.uint8).copy(),
        np.array(msg.scores, dtype=np.float32),
    )

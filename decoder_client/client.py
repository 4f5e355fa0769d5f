"""``DraftClient``: what an inference server embeds to get draft trees from draftcache.

One batched call per decode step serves the whole batch; each session sends only the tokens
produced since its previous call. Every call has a deadline (a few milliseconds by default): if
the service is slow or down, the client answers from a local fallback drafter (prompt lookup
over the session's own context) instead, so decoding never waits on the cache. A session whose
server copy may have missed tokens (a call that failed midway) is re-opened with its full
context the next time the service answers.

Calls travel on two long-lived bidirectional streams per client (``stream=True``, the
default): a message on an open stream costs the service about half of what a unary call does.
Drafts have one to themselves; opens and closes share the other, so a long prompt
being indexed or a commit never holds up a draft queued behind it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from secrets import token_hex
from typing import Any

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client import wire
from indexer.drafter import MAX_LOOKAHEAD, DraftParams
from indexer.prespeculation import Prefetched, select
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
    lookahead: int = 0  # pre-speculation: outcomes drafted ahead per step (0: off)
    stream: bool = True  # calls on two bidirectional streams (False: one unary call each)
    token: str = ""  # bearer token, when the service authenticates callers
    tls_root_cert_file: str = ""  # PEM CA of the service's certificate: use TLS
    tls_cert_file: str = ""  # this client's certificate and key, for mutual TLS
    tls_key_file: str = ""

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.control_timeout_s <= 0 or self.retry_after_s < 0:
            raise ValueError("deadlines must be > 0 and retry_after_s >= 0")
        if not 0 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {self.lookahead}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("a client certificate needs its key (and the other way round)")
        if self.tls_cert_file and not self.tls_root_cert_file:
            raise ValueError("mutual TLS needs tls_root_cert_file too")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials from the configured PEM files; None: plaintext."""
        if not self.tls_root_cert_file:
            return None
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        return grpc.ssl_channel_credentials(
            read(self.tls_root_cert_file), read(self.tls_key_file), read(self.tls_cert_file)
        )


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class ClientSession:
    """The client's view of one request: its full context and its server session, if any.

    The context is kept as a list that a decode step appends its few tokens to: copying whole
    contexts into new arrays every step would cost the decoder time quadratic in a request's
    length. ``context`` makes an array of it (the local fallback and re-opens read it, rarely).
    """

    __slots__ = ("_tokens", "pending", "prefetched", "prompt_len", "server_id")

    def __init__(self, context: Sequence[int] | np.ndarray, prompt_len: int) -> None:
        self._tokens: list[int] = np.asarray(context, dtype=np.int32).tolist()
        self.prompt_len = prompt_len
        self.server_id = ""  # "" while the service has no valid copy
        self.pending: list[int] = []  # produced since the last successful call
        self.prefetched: Prefetched = {}  # trees drafted ahead for the next outcome

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def context(self) -> np.ndarray:
        return np.array(self._tokens, dtype=np.int32)

    def tokens(self, start: int = 0) -> list[int]:
        """The context's tokens from ``start`` on, as a new list."""
        return self._tokens[start:]

    def extend(self, new: Sequence[int] | np.ndarray) -> None:
        """Append tokens the target produced (to the context, and to what the service has yet to hear)."""
        if isinstance(new, np.ndarray):
            if new.dtype.kind not in "iu":
                raise TypeError(f"token ids must be integers, got an array of {new.dtype}")
            values = new.tolist()
        else:
            values = [int(t) for t in new]
        if values and not (min(values) >= _INT32_MIN and max(values) <= _INT32_MAX):
            raise OverflowError(f"token ids must be int32, got {values}")
        self._tokens.extend(values)
        self.pending.extend(values)


@dataclass
class ClientStats:
    remote: int = 0  # trees that came from the service
    fallback: int = 0  # trees the local drafter made
    failures: int = 0  # calls that failed or missed their deadline
    reopened: int = 0
    ahead_hits: int = 0  # trees that were drafted ahead (no wait)
    ahead_misses: int = 0  # outcomes nothing had been drafted ahead for
    lost_opens: int = 0  # opens given up on (deadline): the service may hold copies until they expire


_LateCall = tuple[list[tuple[ClientSession, str]], Any]  # (sessions with their server ids, the call)


class _Core:
    """The client's bookkeeping without I/O, shared by the sync and the asyncio client."""

    def __init__(self, config: ClientConfig, fallback: Fallback) -> None:
        self.config = config
        self.stats = ClientStats()
        self.fallback = fallback
        self.down_until = 0.0
        self.abandoned: list[str] = []  # server sessions given up on (closed when the service answers)
        self.late: list[_LateCall] = []  # see :meth:`missed`
        self.columns = True  # draft calls in columns (False once a server showed it predates them)
        wire.warm_up()  # the response reader is compiled now, not on the first step's deadline
        # And the fallback runs once: what it compiles (seconds on a fresh machine) must not
        # land on the first step the service misses, when the decoder has no time to spare.
        fallback(np.array([1, 2, 1], dtype=np.int32), 2)
        p = config.params
        self.params = pb.DraftParams(
            budget=p.budget, max_depth=p.max_depth, min_score=p.min_score, depth_reserve=p.depth_reserve
        )

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, exc: grpc.RpcError | None) -> None:
        """A call failed (``None``: it missed its deadline in the background)."""
        self.stats.failures += 1
        self.down_until = time.monotonic() + self.config.retry_after_s
        why = "deadline" if exc is None else exc.code()
        logger.debug("draftcache call failed (%s); local drafts for %.1f s", why, self.config.retry_after_s)

    def add_tokens(self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]) -> None:
        for s, new in zip(sessions, new_tokens, strict=True):
            if len(new):
                s.extend(new)

    def open_request(self, sessions: Sequence[ClientSession]) -> pb.OpenSessionsRequest | None:
        todo = [s for s in sessions if not s.server_id]
        if not todo or not self.available():
            return None
        ns = self.config.namespace
        return pb.OpenSessionsRequest(  # ids chosen here: an open given up on can still be closed
            sessions=[
                pb.OpenSession(namespace=ns, prompt=s.tokens(), params=self.params, session_id=token_hex(16))
                for s in todo
            ]
        )

    def open_failed(self, req: pb.OpenSessionsRequest, exc: grpc.RpcError) -> None:
        """An open call failed: the service may still have made the sessions (a missed deadline
        above all), so they are closed, if they exist, once it answers again."""
        self.failed(exc)
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            self.stats.lost_opens += len(req.sessions)
        self.abandoned.extend(s.session_id for s in req.sessions)

    def opened(
        self, sessions: Sequence[ClientSession], resp: pb.OpenSessionsResponse, sizes: Sequence[int] | None = None
    ) -> None:
        """Book the server ids of an open request made for ``sessions`` (those without one);
        ``sizes``: their context sizes when it was sent (tokens added since are pending)."""
        todo = [s for s in sessions if not s.server_id]
        sizes = [len(s) for s in todo] if sizes is None else sizes
        for s, sid, size in zip(todo, resp.session_ids, sizes, strict=True):
            if s.prompt_len != size:
                self.stats.reopened += 1
            s.server_id, s.pending = sid, s.tokens(size)

    def draft_request(self, sessions: Sequence[ClientSession]) -> pb.DraftRequest | None:
        remote = [s for s in sessions if s.server_id]
        if not remote or not self.available():
            return None
        k = self.config.lookahead
        if not self.columns:
            return pb.DraftRequest(
                items=[pb.DraftItem(session_id=s.server_id, new_tokens=s.pending, lookahead=k) for s in remote]
            )
        pending = [s.pending for s in remote]
        return pb.DraftRequest(
            columns=pb.DraftColumns(
                session_ids=[s.server_id for s in remote],
                new_token_counts=[len(p) for p in pending],
                new_tokens=[t for p in pending for t in p],
                lookahead=[k] * len(remote) if k else [],
            )
        )

    def split_ahead(
        self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]
    ) -> tuple[dict[int, DraftTree], list[ClientSession]]:
        """Trees already drafted ahead for what each session just produced, by session, and the
        sessions that still need a draft call."""
        ready: dict[int, DraftTree] = {}
        rest = []
        for s, new in zip(sessions, new_tokens, strict=True):
            tree = select(s.prefetched, new) if s.server_id and s.prefetched and len(new) else None
            s.prefetched = {}
            if tree is None:
                if self.config.lookahead and s.server_id and len(new):
                    self.stats.ahead_misses += 1
                rest.append(s)
            else:
                self.stats.ahead_hits += 1
                self.stats.remote += 1
                ready[id(s)] = tree
        return ready, rest

    def in_doubt(self, sessions: Sequence[ClientSession]) -> None:
        """Their server copies may have missed tokens: they are closed, and the sessions
        re-opened with their full context later."""
        for s in sessions:
            if s.server_id:
                self.abandoned.append(s.server_id)
                s.server_id = ""

    def missed(self, sessions: Sequence[ClientSession], call: Any) -> None:
        """A draft ``call`` missed its deadline on a stream. It still reaches the service, which
        answers in order: its tokens join the server copies before anything sent after it, so
        the sessions keep them. The call is kept, with their server ids, to put them in doubt
        should it fail after all (:meth:`due`, :meth:`late_failed`)."""
        pairs = []
        for s in sessions:
            if s.server_id:
                s.pending, s.prefetched = [], {}
                pairs.append((s, s.server_id))
        self.late.append((pairs, call))

    def due(self, wait_for: Sequence[ClientSession] | None) -> list[_LateCall]:
        """The late calls to book now: those that ended, and those of ``wait_for`` (None: all),
        which the caller waits for; the others stay."""
        waiting = None if wait_for is None else {id(s) for s in wait_for}
        due: list[_LateCall] = []
        keep: list[_LateCall] = []
        for pairs, call in self.late:
            now = waiting is None or call.done() or any(id(s) in waiting for s, _ in pairs)
            (due if now else keep).append((pairs, call))
        self.late = keep
        return due

    def late_failed(self, pairs: Sequence[tuple[ClientSession, str]]) -> None:
        """A late call failed after all: the sessions still on the copies it went to are in doubt."""
        self.in_doubt([s for s, sid in pairs if s.server_id == sid])

    def answered(self, sessions: Sequence[ClientSession], resp: pb.DraftResponse | None) -> None:
        """Book a draft call's outcome: tokens delivered and trees drafted ahead, or the
        sessions' server copies in doubt."""
        remote = [s for s in sessions if s.server_id]
        if resp is None:
            self.in_doubt(remote)
            return
        ahead = wire.prefetched_from_response(resp) if len(resp.prefetched) else [{} for _ in remote]
        for s, more in zip(remote, ahead, strict=True):
            s.pending = []
            s.prefetched = more

    def trees(
        self, sessions: Sequence[ClientSession], resp: pb.DraftResponse | None, *, book: bool = True
    ) -> list[DraftTree]:
        """Remote trees where the service answered, local ones everywhere else; ``book``: the
        call's outcome too (see :meth:`answered`)."""
        remote = [s for s in sessions if s.server_id]
        drafted: list[DraftTree] = []
        if resp is not None:
            drafted = wire.trees_from_response(resp)
            if len(drafted) == len(remote):
                self.stats.remote += len(remote)
            else:  # not an answer to this call: the sessions' server copies are in doubt
                logger.warning("draft call for %d sessions answered with %d trees", len(remote), len(drafted))
                if remote and not drafted and self.columns:
                    # A server that predates columnar calls reads none of them and drafts nothing.
                    self.columns = False
                resp, drafted = None, []
        if book:
            self.answered(sessions, resp)
        if resp is not None and len(remote) == len(sessions):  # the service answered for every sequence
            return drafted
        got = dict(zip(map(id, remote), drafted, strict=True)) if resp is not None else {}
        out = []
        for s in sessions:
            tree = got.get(id(s))
            if tree is None:
                self.stats.fallback += 1
                tree = self.fallback(s.context, self.config.params.budget)
            out.append(tree)
        return out

    def abandoned_request(self, *, now: bool = False) -> pb.CloseSessionsRequest | None:
        """Close (without commit) the server sessions given up on, once the service is used
        again (``now``: anyway, the client is shutting down)."""
        if not self.abandoned or not (now or self.available()):
            return None
        ids, self.abandoned = self.abandoned, []
        return pb.CloseSessionsRequest(
            sessions=[pb.CloseSession(session_id=sid, commit=False, missing_ok=True) for sid in ids]
        )

    def close_request(self, sessions: Sequence[ClientSession], commit: bool) -> pb.CloseSessionsRequest | None:
        """One call ending the sessions' server copies, each with its last step's tokens."""
        live = [s for s in sessions if s.server_id]
        if not self.available():  # the service is being skipped: close them once it is used again
            self.in_doubt(live)
            return None
        if not live:
            return None
        close = pb.CloseSessionsRequest(
            sessions=[pb.CloseSession(session_id=s.server_id, commit=commit, new_tokens=s.pending) for s in live]
        )
        for s in live:
            s.pending = []
        return close

    def close_settled(self, req: pb.CloseSessionsRequest, exc: BaseException | None) -> None:
        """Book a close call run in the background: when it failed, its sessions are closed
        (without commit) once the service is used again, or at shutdown."""
        if exc is not None:
            if isinstance(exc, grpc.RpcError):
                self.failed(exc)
            self.abandoned.extend(c.session_id for c in req.sessions)


_UNARY = {"open": "OpenSessions", "draft": "Draft", "close": "CloseSessions"}


def _lane(kind: str) -> str:
    """Drafts have a stream to themselves; opens and closes share the other."""
    return "draft" if kind == "draft" else "control"


class _StreamEnded(grpc.RpcError):
    """The service ended a stream without a status (it is replaced at the next call)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "stream ended"


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Failed(grpc.RpcError):
    """A request the service answered on a stream with an error status (the stream goes on)."""

    def __init__(self, error: pb.StreamError) -> None:
        super().__init__(error.message)
        self._code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
        self._details = error.message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _reply(msg: pb.StreamResponse, kind: str) -> Any:
    """The body a stream reply carries for a request of ``kind``; raises its error status."""
    if msg.WhichOneof("body") == "error":
        raise _Failed(msg.error)
    return getattr(msg, kind)


class _Late(grpc.RpcError):
    """A request on a stream past its deadline: what a unary call reports as DEADLINE_EXCEEDED."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "deadline exceeded"


class _StreamFuture:
    """One request's reply on a :class:`_Stream`, with a unary call future's interface:
    ``result(timeout)`` raises ``grpc.FutureTimeoutError`` past ``timeout``, DEADLINE_EXCEEDED
    past the request's own deadline and the stream's status if the stream broke; ``done`` is
    true from the deadline on; ``cancel`` forgets the request (a late reply is dropped)."""

    def __init__(self, stream: _Stream, request_id: int, kind: str, deadline: float) -> None:
        self._stream = stream
        self.request_id = request_id
        self.kind = kind
        self._deadline = deadline
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> Any:
        left = self._deadline - time.monotonic()
        try:
            return self.future.result(max(0.0, left if timeout is None else min(timeout, left)))
        except concurrent.futures.TimeoutError:
            if timeout is not None and timeout < left:
                raise grpc.FutureTimeoutError() from None
            self.cancel()
            self._stream.stall()
            raise _Late() from None

    def done(self) -> bool:
        return self.future.done() or time.monotonic() >= self._deadline

    def cancel(self) -> bool:
        self._stream.forget(self.request_id)
        return True


class _Stream:
    """Requests on one bidirectional stream, answered in order by the service. A reader thread
    matches replies to requests by id; when the stream breaks, every request in flight fails
    with its status and ``error`` tells the owner to start another."""

    def __init__(self, stub: pb_grpc.DraftCacheStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._out: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._waiting: dict[int, _StreamFuture] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.error: grpc.RpcError | None = None
        self._call = stub.Stream(iter(self._out.get, None), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="draftcache-stream", daemon=True)
        self._reader.start()

    def call(self, kind: str, request: Any, timeout: float) -> _StreamFuture:
        reply = _StreamFuture(self, next(self._ids), kind, time.monotonic() + timeout)
        with self._lock:
            if self.error is not None:
                reply.future.set_exception(self.error)
                return reply
            self._waiting[reply.request_id] = reply
        self._out.put(pb.StreamRequest(request_id=reply.request_id, **{kind: request}))
        return reply

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)

    def stall(self) -> None:
        """A request got no answer by its deadline: the service answers in order, so the
        stream is stuck (a dead connection, or a backlog) and is replaced; what is in flight
        on it fails."""
        with self._lock:
            self.error = self.error or _Late()
        self._call.cancel()

    def _read(self) -> None:
        error: grpc.RpcError = _StreamEnded()
        try:
            for msg in self._call:
                with self._lock:
                    reply = self._waiting.pop(msg.request_id, None)
                if reply is not None:
                    try:
                        reply.future.set_result(_reply(msg, reply.kind))
                    except _Failed as exc:
                        reply.future.set_exception(exc)
        except grpc.RpcError as exc:
            error = exc
        with self._lock:
            self.error = error
            waiting, self._waiting = self._waiting, {}
        for reply in waiting.values():
            reply.future.set_exception(error)

    def close(self, timeout: float) -> None:
        """Half-close (the service answers what it holds, then ends the stream), then cancel."""
        self._out.put(None)
        self._reader.join(timeout)
        self._call.cancel()


class _AsyncStream:
    """The asyncio twin of :class:`_Stream`: a writer task sends requests in order, a reader
    task matches replies to them."""

    def __init__(self, stub: pb_grpc.DraftCacheStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._call = stub.Stream(metadata=metadata)
        self._out: asyncio.Queue[pb.StreamRequest | None] = asyncio.Queue()
        self._waiting: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self._ids = itertools.count(1)
        self.error: grpc.RpcError | None = None
        self._reader = asyncio.ensure_future(self._read())
        self._writer = asyncio.ensure_future(self._write())

    def call(self, kind: str, request: Any) -> asyncio.Future[Any]:
        """The reply's future (a request given up on needs nothing more: a late reply is dropped)."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.error is not None:
            reply.set_exception(self.error)
            return reply
        request_id = next(self._ids)
        self._waiting[request_id] = (reply, kind)
        self._out.put_nowait(pb.StreamRequest(request_id=request_id, **{kind: request}))
        return reply

    async def _write(self) -> None:
        try:
            while (msg := await self._out.get()) is not None:
                await self._call.write(msg)
            await self._call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:  # the stream is over
            self._broken(exc if isinstance(exc, grpc.RpcError) else _StreamEnded())

    async def _read(self) -> None:
        error: grpc.RpcError = _StreamEnded()
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                reply, kind = self._waiting.pop(msg.request_id, (None, ""))
                if reply is not None and not reply.done():
                    try:
                        reply.set_result(_reply(msg, kind))
                    except _Failed as exc:
                        reply.set_exception(exc)
        except grpc.RpcError as exc:
            error = exc
        except asyncio.CancelledError:
            pass
        self._broken(error)

    def _broken(self, error: grpc.RpcError) -> None:
        self.error = self.error or error
        waiting, self._waiting = self._waiting, {}
        for reply, _ in waiting.values():
            if not reply.done():
                reply.set_exception(self.error)

    async def close(self, timeout: float) -> None:
        """Half-close once the queued requests are sent, wait for the answers, then cancel."""
        self._out.put_nowait(None)
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        self.cancel()

    def cancel(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        self._writer.cancel()

    def stall(self) -> None:
        """See :meth:`_Stream.stall`."""
        self._broken(_Late())
        self.cancel()


async def _within(stream: _AsyncStream, reply: asyncio.Future[Any], timeout: float) -> Any:
    """A stream reply, or DEADLINE_EXCEEDED past ``timeout`` (as a unary call would; the
    stream is then replaced, see :meth:`_Stream.stall`)."""
    try:
        return await asyncio.wait_for(reply, timeout)
    except TimeoutError:
        stream.stall()
        raise _Late() from None


class DraftClient:
    """Sync client; see the module docstring.

    >>> client = DraftClient(ClientConfig(target="127.0.0.1:50051", namespace="llama2"))  # doctest: +SKIP
    >>> sessions = client.open([[1, 2, 3]])  # doctest: +SKIP
    >>> trees = client.draft(sessions, [[]])  # doctest: +SKIP
    """

    def __init__(self, config: ClientConfig, fallback: Fallback = prompt_lookup_fallback) -> None:
        self._core = _Core(config, fallback)
        # Reconnect quickly after an outage: the fallback covers the gap, not a long backoff.
        creds = config.credentials()
        self._channel = (
            grpc.insecure_channel(config.target, options=RECONNECT_OPTIONS)
            if creds is None
            else grpc.secure_channel(config.target, creds, options=RECONNECT_OPTIONS)
        )
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._streams: dict[str, _Stream] = {}  # by lane
        self._inflight: tuple[list[ClientSession], grpc.Future | _StreamFuture] | None = None
        self._opening: (
            tuple[list[ClientSession], list[int], pb.OpenSessionsRequest, grpc.Future | _StreamFuture] | None
        ) = None
        self._background: list[grpc.Future | _StreamFuture] = []  # calls nobody waits for (kept until done)
        self._closing: list[tuple[pb.CloseSessionsRequest, grpc.Future | _StreamFuture]] = []

    @property
    def config(self) -> ClientConfig:
        return self._core.config

    @property
    def stats(self) -> ClientStats:
        return self._core.stats

    def open(self, prompts: Sequence[Sequence[int] | np.ndarray], *, wait: bool = True) -> list[ClientSession]:
        """A session per prompt. With ``wait`` the call returns once the service holds them;
        without, they are opened in the background (now, or with a later draft call while
        another open is under way) and draft locally until then: a decoder admitting requests
        into a running batch never waits on the service."""
        sessions = [ClientSession(np.asarray(p, dtype=np.int32), len(p)) for p in prompts]
        if wait:
            self._open(sessions)
        else:
            self._reopen(sessions)
        return sessions

    def draft(self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]) -> list[DraftTree]:
        """Append each session's new tokens, then one tree per session (remote or fallback).

        With ``lookahead``, a session whose outcome was drafted ahead gets that tree at once;
        the call that delivers its tokens and drafts ahead for its next outcome runs in the
        background (while the target verifies) and is settled at the next call.
        """
        end = time.monotonic() + self.config.deadline_s
        self._settle(end)
        self._check_late()
        self._reap()
        self._core.add_tokens(sessions, new_tokens)
        self._reopen(sessions)
        ready, rest = self._core.split_ahead(sessions, new_tokens)
        req = self._core.draft_request(rest)
        left = end - time.monotonic()
        resp, late = self._draft(req, left) if req is not None and left > 0 else (None, None)
        if late is not None:
            self._core.missed(rest, late)
        trees = self._core.trees(rest, resp, book=late is None)
        if not ready:  # nothing was drafted ahead: every tree is fresh, in order
            return trees
        fresh = dict(zip(map(id, rest), trees, strict=True))
        ahead = [s for s in sessions if id(s) in ready]
        req = self._core.draft_request(ahead)
        if req is not None:
            self._inflight = (ahead, self._future("draft", req, self.config.control_timeout_s))
        return [ready[id(s)] if id(s) in ready else fresh[id(s)] for s in sessions]

    def _settle(self, end: float | None = None) -> None:
        """Wait (at most until ``end``, or the deadline) for the background call of the
        previous step."""
        if self._inflight is None:
            return
        sessions, future = self._inflight
        self._inflight = None
        wait = self.config.deadline_s if end is None else max(0.0, end - time.monotonic())
        try:
            resp = future.result(timeout=wait)
        except grpc.FutureTimeoutError:
            self._core.failed(None)
            if isinstance(future, _StreamFuture):  # it still counts, once answered
                self._core.missed(sessions, future)
                return
            future.cancel()
            resp = None
        except grpc.RpcError as exc:
            self._core.failed(exc)
            resp = None
        self._core.answered(sessions, resp)

    def _draft(self, req: pb.DraftRequest, left: float) -> tuple[pb.DraftResponse | None, _StreamFuture | None]:
        """The reply within ``left``, or None; on a stream, a call that missed ``left`` is
        returned too: the service still applies it (see :meth:`_Core.missed`)."""
        if not self.config.stream:
            return self._call("draft", req, left), None
        reply = self._stream("draft").call("draft", req, self.config.control_timeout_s)
        try:
            return reply.result(timeout=left), None
        except grpc.FutureTimeoutError:
            self._core.failed(None)
            return None, reply
        except grpc.RpcError as exc:
            self._core.failed(exc)
            return None, None

    def _check_late(self, wait_for: Sequence[ClientSession] | None = ()) -> None:
        """Book the late draft calls that ended: the sessions of one that failed (or got no
        answer in time) are put in doubt. Those of ``wait_for`` (None: all) are waited for."""
        for pairs, future in self._core.due(wait_for):
            try:
                future.result()  # at most until its deadline
            except grpc.RpcError:
                self._core.late_failed(pairs)

    def add_tokens(self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]) -> None:
        """Record tokens produced without asking for a draft (a request's last step): they go
        with the next call, a close included."""
        self._core.add_tokens(sessions, new_tokens)

    def close(self, sessions: Sequence[ClientSession], *, commit: bool = True) -> None:
        """End the requests; with ``commit`` the service adds them to its lifetime memory. One
        call carries their last step's tokens and runs in the background: its outcome is booked
        at the next call (a failed close ends the server copies without commit later)."""
        self._settle()
        self._check_late(sessions)  # their tokens must be in before the close (another stream)
        self._land_reopen()
        self._reap()
        close = self._core.close_request(sessions, commit)
        if close is not None:  # in the background: committing indexes the requests first
            self._closing.append((close, self._future("close", close, self.config.control_timeout_s)))

    def _reap(self, *, wait: bool = False) -> None:
        """Book the background closes that ended (``wait``: all of them, each at most until its
        deadline)."""
        pending = []
        for req, future in self._closing:
            if not (wait or future.done()):
                pending.append((req, future))
                continue
            try:
                future.result()
                self._core.close_settled(req, None)
            except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError) as exc:
                self._core.close_settled(req, exc)
        self._closing = pending

    def shutdown(self) -> None:
        """Settle calls in flight, close the server copies given up on, close the channel."""
        self._settle()
        self._check_late(None)
        self._land_reopen()
        self._reap(wait=True)
        req = self._core.abandoned_request(now=True)
        if req is not None:
            self._call("close", req, self.config.control_timeout_s)
        for future in self._background:
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
                future.result(timeout=self.config.control_timeout_s)
        for stream in self._streams.values():
            stream.close(self.config.control_timeout_s)
        self._streams.clear()
        self._channel.close()

    def _land_reopen(self) -> None:
        """Let a re-open in flight land, so its copy is closed too."""
        if self._opening is not None:
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                self._opening[3].result(timeout=self.config.control_timeout_s)
            self._reopen([])

    def _open(self, sessions: Sequence[ClientSession]) -> None:
        req = self._core.open_request(sessions)
        if req is None:
            return
        try:
            resp = self._request("open", req, self.config.control_timeout_s)
        except grpc.RpcError as exc:
            self._core.open_failed(req, exc)
            return
        self._core.opened(sessions, resp)
        self._close_abandoned()

    def _reopen(self, sessions: Sequence[ClientSession]) -> None:
        """Sessions without a server copy (the service failed or restarted) are re-opened with
        their full context in the background, never inside a draft call's deadline (a long
        context takes a while to send and index): they draft locally until it is done."""
        if self._opening is not None:
            todo, sizes, req, future = self._opening
            if not future.done():
                return
            self._opening = None
            try:
                self._core.opened(todo, future.result(), sizes)
                self._close_abandoned()
            except grpc.RpcError as exc:
                self._core.open_failed(req, exc)
        todo = [s for s in sessions if not s.server_id]
        req = self._core.open_request(todo)
        if req is not None:
            future = self._future("open", req, self.config.control_timeout_s)
            self._opening = (todo, [len(s) for s in todo], req, future)

    def _close_abandoned(self) -> None:
        """Best effort, in the background: an unknown id (the server restarted) is fine too.
        The future is kept until done: gRPC cancels a call whose future is garbage-collected."""
        req = self._core.abandoned_request()
        if req is not None:
            future = self._future("close", req, self.config.control_timeout_s)
            self._background = [f for f in self._background if not f.done()] + [future]

    def _stream(self, kind: str) -> _Stream:
        """The live stream of ``kind``'s lane (another one when it broke)."""
        lane = _lane(kind)
        stream = self._streams.get(lane)
        if stream is None or stream.error is not None:
            if stream is not None:
                stream.close(0)
            stream = self._streams[lane] = _Stream(self._stub, self.config.metadata)
        return stream

    def _future(self, kind: str, req: Any, timeout: float) -> grpc.Future | _StreamFuture:
        """A call under way: on its lane's stream, or unary."""
        if self.config.stream:
            return self._stream(kind).call(kind, req, timeout)
        return getattr(self._stub, _UNARY[kind]).future(req, timeout=timeout, metadata=self.config.metadata)

    def _request(self, kind: str, req: Any, timeout: float) -> Any:
        """The reply within ``timeout``; raises the call's ``grpc.RpcError``."""
        if self.config.stream:
            return self._stream(kind).call(kind, req, timeout).result()
        return getattr(self._stub, _UNARY[kind])(req, timeout=timeout, metadata=self.config.metadata)

    def _call(self, kind: str, req: Any, timeout: float) -> Any:
        """:meth:`_request`, or None when it failed (the service is then skipped a while)."""
        try:
            return self._request(kind, req, timeout)
        except grpc.RpcError as exc:
            self._core.failed(exc)
            return None


class AsyncDraftClient:
    """The asyncio twin of :class:`DraftClient` (same bookkeeping, ``grpc.aio`` transport)."""

    def __init__(self, config: ClientConfig, fallback: Fallback = prompt_lookup_fallback) -> None:
        self._core = _Core(config, fallback)
        creds = config.credentials()
        self._channel = (
            grpc.aio.insecure_channel(config.target, options=RECONNECT_OPTIONS)
            if creds is None
            else grpc.aio.secure_channel(config.target, creds, options=RECONNECT_OPTIONS)
        )
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._streams: dict[str, _AsyncStream] = {}  # by lane
        self._inflight: tuple[list[ClientSession], asyncio.Future] | None = None
        self._opening: tuple[list[ClientSession], list[int], pb.OpenSessionsRequest, asyncio.Future] | None = None
        self._background: set[asyncio.Future] = set()
        self._closing: set[asyncio.Future] = set()  # background closes (booked as each ends)

    @property
    def stats(self) -> ClientStats:
        return self._core.stats

    async def open(self, prompts: Sequence[Sequence[int] | np.ndarray], *, wait: bool = True) -> list[ClientSession]:
        """See :meth:`DraftClient.open`."""
        sessions = [ClientSession(np.asarray(p, dtype=np.int32), len(p)) for p in prompts]
        if wait:
            await self._open(sessions)
        else:
            self._reopen(sessions)
        return sessions

    async def draft(self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]) -> list[DraftTree]:
        """See :meth:`DraftClient.draft`."""
        end = time.monotonic() + self._core.config.deadline_s
        await self._settle(end)
        await self._check_late()
        self._core.add_tokens(sessions, new_tokens)
        self._reopen(sessions)
        ready, rest = self._core.split_ahead(sessions, new_tokens)
        req = self._core.draft_request(rest)
        left = end - time.monotonic()
        resp, late = await self._draft(req, left) if req is not None and left > 0 else (None, None)
        if late is not None:
            self._core.missed(rest, late)
        trees = self._core.trees(rest, resp, book=late is None)
        if not ready:  # nothing was drafted ahead: every tree is fresh, in order
            return trees
        fresh = dict(zip(map(id, rest), trees, strict=True))
        ahead = [s for s in sessions if id(s) in ready]
        req = self._core.draft_request(ahead)
        if req is not None:
            self._inflight = (ahead, self._future("draft", req, self._core.config.control_timeout_s))
        return [ready[id(s)] if id(s) in ready else fresh[id(s)] for s in sessions]

    async def _settle(self, end: float | None = None) -> None:
        if self._inflight is None:
            return
        sessions, task = self._inflight
        self._inflight = None
        resp = None
        wait = self._core.config.deadline_s if end is None else max(0.0, end - time.monotonic())
        try:
            resp = await asyncio.wait_for(asyncio.shield(task), timeout=wait)
        except TimeoutError:
            self._core.failed(None)
            if self._core.config.stream:  # it still counts, once answered
                self._core.missed(sessions, task)
                return
            task.cancel()
        except grpc.RpcError as exc:
            self._core.failed(exc)
        self._core.answered(sessions, resp)

    async def _draft(self, req: pb.DraftRequest, left: float) -> tuple[pb.DraftResponse | None, asyncio.Future | None]:
        """See :meth:`DraftClient._draft`."""
        cfg = self._core.config
        if not cfg.stream:
            return await self._call("draft", req, left), None
        task = self._future("draft", req, cfg.control_timeout_s)
        try:
            return await asyncio.wait_for(asyncio.shield(task), left), None
        except TimeoutError:
            self._core.failed(None)
            return None, task
        except grpc.RpcError as exc:
            self._core.failed(exc)
            return None, None

    async def _check_late(self, wait_for: Sequence[ClientSession] | None = ()) -> None:
        """See :meth:`DraftClient._check_late`."""
        for pairs, task in self._core.due(wait_for):
            await asyncio.wait({task})  # at most until its deadline
            if task.cancelled() or task.exception() is not None:
                self._core.late_failed(pairs)

    def add_tokens(self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]) -> None:
        """See :meth:`DraftClient.add_tokens`."""
        self._core.add_tokens(sessions, new_tokens)

    async def close(self, sessions: Sequence[ClientSession], *, commit: bool = True) -> None:
        await self._settle()
        await self._check_late(sessions)
        await self._land_reopen()
        close = self._core.close_request(sessions, commit)
        if close is not None:  # in the background: committing indexes the requests first
            task = self._future("close", close, self._core.config.control_timeout_s)
            task.add_done_callback(partial(self._closed, close))
            self._closing.add(task)

    def _closed(self, req: pb.CloseSessionsRequest, task: asyncio.Future) -> None:
        self._closing.discard(task)
        self._core.close_settled(req, asyncio.CancelledError() if task.cancelled() else task.exception())

    async def shutdown(self) -> None:
        """See :meth:`DraftClient.shutdown`."""
        await self._settle()
        await self._check_late(None)
        await self._land_reopen()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=self._core.config.control_timeout_s)
            for task in list(self._closing):  # still not answered: given up on
                task.cancel()
            await asyncio.sleep(0)  # their callbacks book them
        req = self._core.abandoned_request(now=True)
        if req is not None:
            await self._call("close", req, self._core.config.control_timeout_s)
        if self._background:
            await asyncio.wait(self._background, timeout=self._core.config.control_timeout_s)
        for stream in self._streams.values():
            await stream.close(self._core.config.control_timeout_s)
        self._streams.clear()
        await self._channel.close()

    async def _land_reopen(self) -> None:
        if self._opening is not None:  # let a re-open in flight land, so its copy is closed too
            with contextlib.suppress(grpc.RpcError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._opening[3]), self._core.config.control_timeout_s)
            self._reopen([])

    def _reopen(self, sessions: Sequence[ClientSession]) -> None:
        """See :meth:`DraftClient._reopen`."""
        if self._opening is not None:
            todo, sizes, req, task = self._opening
            if not task.done():
                return
            self._opening = None
            exc = task.exception()
            if exc is None:
                self._core.opened(todo, task.result(), sizes)
                self._close_abandoned()
            elif isinstance(exc, grpc.RpcError):
                self._core.open_failed(req, exc)
        todo = [s for s in sessions if not s.server_id]
        req = self._core.open_request(todo)
        if req is not None:
            task = self._future("open", req, self._core.config.control_timeout_s)
            self._opening = (todo, [len(s) for s in todo], req, task)

    async def _open(self, sessions: Sequence[ClientSession]) -> None:
        req = self._core.open_request(sessions)
        if req is not None:
            try:
                resp = await self._request("open", req, self._core.config.control_timeout_s)
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one
                self._core.open_failed(req, exc)
                return
            self._core.opened(sessions, resp)
            self._close_abandoned()

    def _close_abandoned(self) -> None:
        """Best effort, not awaited: an unknown id (the server restarted) is fine too."""
        abandoned = self._core.abandoned_request()
        if abandoned is not None:
            task = self._future("close", abandoned, self._core.config.control_timeout_s)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures are fine
            self._background = {t for t in self._background if not t.done()} | {task}

    def _stream(self, kind: str) -> _AsyncStream:
        """See :meth:`DraftClient._stream`."""
        lane = _lane(kind)
        stream = self._streams.get(lane)
        if stream is None or stream.error is not None:
            if stream is not None:
                stream.cancel()
            stream = self._streams[lane] = _AsyncStream(self._stub, self._core.config.metadata)
        return stream

    def _future(self, kind: str, req: Any, timeout: float) -> asyncio.Future:
        """A call under way (a task that raises the call's ``grpc.RpcError``)."""
        cfg = self._core.config
        if cfg.stream:
            stream = self._stream(kind)
            return asyncio.ensure_future(_within(stream, stream.call(kind, req), timeout))
        return asyncio.ensure_future(getattr(self._stub, _UNARY[kind])(req, timeout=timeout, metadata=cfg.metadata))

    async def _request(self, kind: str, req: Any, timeout: float) -> Any:
        cfg = self._core.config
        if cfg.stream:
            stream = self._stream(kind)
            return await _within(stream, stream.call(kind, req), timeout)
        return await getattr(self._stub, _UNARY[kind])(req, timeout=timeout, metadata=cfg.metadata)

    async def _call(self, kind: str, req: Any, timeout: float) -> Any:
        try:
            return await self._request(kind, req, timeout)
        except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one
            self._core.failed(exc)
            return None


def tree_from_proto(msg: pb.Tree) -> DraftTree:
    """A wire tree as the domain type."""
    return DraftTree(
        np.array(msg.tokens, dtype=np.int32),
        np.array(msg.parents, dtype=np.int32),
        np.frombuffer(msg.sources, dtype=np.uint8).copy(),
        np.array(msg.scores, dtype=np.float32),
    )

"""``DraftClient``: the client for a decoder that calls from threads (``grpc`` futures and
:mod:`~decoder_client.client.stream`'s threaded streams)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, assert_never

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.client.config import ClientConfig
from decoder_client.client.core import ClientCore, ClientStats, Fallback, Reopening, parts, prompt_lookup_fallback
from decoder_client.client.plan import CatchUp, Draft, DraftAhead, Drafted, Effect, Reopen, draft_step
from decoder_client.client.protocol import UNARY, lane_of
from decoder_client.client.session import ClientSession, TopkRows
from decoder_client.client.stream import Stream, StreamFuture
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)


class DraftClient:
    """The sync client; see :mod:`decoder_client.client`.

    >>> client = DraftClient(ClientConfig(target="127.0.0.1:50051", namespace="llama2"))  # doctest: +SKIP
    >>> sessions = client.open([[1, 2, 3]])  # doctest: +SKIP
    >>> trees = client.draft(sessions, [[]])  # doctest: +SKIP
    """

    def __init__(self, config: ClientConfig, fallback: Fallback = prompt_lookup_fallback) -> None:
        self._core = ClientCore(config, fallback)
        self._channel = config.channel()
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._streams: dict[str, Stream] = {}  # by lane
        self._inflight: list[tuple[list[ClientSession], grpc.Future | StreamFuture]] = []  # drafting ahead
        self._opening: tuple[Reopening, grpc.Future | StreamFuture] | None = None
        self._background: list[grpc.Future | StreamFuture] = []  # calls nobody waits for (kept until done)
        self._closing: list[tuple[pb.CloseSessionsRequest, grpc.Future | StreamFuture]] = []
        self._shut_down = False

    @property
    def config(self) -> ClientConfig:
        return self._core.config

    @property
    def stats(self) -> ClientStats:
        return self._core.stats

    def cut_chains_at(self, min_prob: float) -> None:
        """Sessions opened from now on ask for chains that end before a token less likely than
        ``min_prob`` to be reached (the service then picks the best chain above it, which is
        not always the start of its best chain above a lower cut)."""
        self._core.cut_chains_at(min_prob)

    def open(
        self, prompts: Sequence[Sequence[int] | np.ndarray], *, wait: bool = True, wait_s: float = 0.0
    ) -> list[ClientSession]:
        """A session per prompt. With ``wait`` the call returns once the service holds them;
        without, they are opened in the background (now, or with a later draft call while
        another open is under way) and draft locally until then: a decoder admitting requests
        into a running batch never waits on the service, or at most ``wait_s`` (an open that
        lands by then lets the request's first draft come from the service; one that does not
        goes on in the background, and nothing counts as failed)."""
        sessions = [ClientSession(np.asarray(p, dtype=np.int32), len(p)) for p in prompts]
        if wait:
            self._open(sessions)
        else:
            self._reopen(sessions)
            if wait_s > 0:
                self._open_within(sessions, time.monotonic() + wait_s)
        return sessions

    def _open_within(self, sessions: Sequence[ClientSession], end: float) -> None:
        """Land the background opens of ``sessions`` that end before ``end``."""
        while self._opening is not None and not all(s.server_id for s in sessions):
            left = end - time.monotonic()
            if left <= 0:
                return
            opening, future = self._opening
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                future.result(timeout=left)
            if not future.done():
                return
            self._land_opening(opening, future)
            self._reopen(sessions)  # those an earlier open in flight held back

    def draft(
        self,
        sessions: Sequence[ClientSession],
        new_tokens: Sequence[Sequence[int]],
        topk: Sequence[TopkRows | None] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> list[DraftTree]:
        """Append each session's new tokens, then one tree per session (remote or fallback),
        within ``deadline_s`` (None: the configured one; an engine may scale it with its step).

        With ``lookahead``, a session whose outcome was drafted ahead gets that tree at once;
        the call that delivers its tokens and drafts ahead for its next outcome runs in the
        background (while the target verifies) and is settled at the next call.
        """
        step = draft_step(self._core, sessions, new_tokens, topk, deadline_s)
        drafted = None
        while True:
            try:
                effect = step.send(drafted)
            except StopIteration as done:
                return done.value
            drafted = self._perform(effect)

    def _perform(self, effect: Effect) -> list[Drafted] | None:
        """One I/O step of :func:`~decoder_client.client.plan.draft_step`."""
        match effect:
            case CatchUp(end):
                self._settle(end)
                self._check_late()
                self._reap()
            case Reopen(sessions):
                self._reopen(sessions)
            case Draft(reqs, left):
                return self._draft(reqs, left)
            case DraftAhead(parts):
                timeout = self.config.control_timeout_s
                self._inflight = [(sessions, self._future("draft", req, timeout)) for sessions, req in parts]
            case _:  # every effect is handled above (mypy checks it)
                assert_never(effect)
        return None

    def _settle(self, end: float | None = None) -> None:
        """Wait (at most until ``end``, or the deadline) for the background calls of the
        previous step."""
        if not self._inflight:
            return
        inflight, self._inflight = self._inflight, []
        end = time.monotonic() + self.config.deadline_s if end is None else end
        late = []
        for sessions, future in inflight:
            try:
                resp = future.result(timeout=max(0.0, end - time.monotonic()))
            except grpc.FutureTimeoutError:
                late.append((sessions, future))
                continue
            except grpc.RpcError as exc:
                if self._core.failed(exc):  # refused for its size: it changed nothing
                    continue
                resp = None
            self._core.answered(sessions, resp)
        if late:
            for future in self._core.ahead_late(late):
                future.cancel()

    def _draft(self, reqs: list[pb.DraftRequest], left: float) -> list[Drafted]:
        """Each call's reply within ``left``, or None; on a stream, a call that missed ``left``
        is returned too: the service still applies it (see :meth:`ClientCore.missed`). The
        time they took is counted (``stats.draft_wait_s``)."""
        with self._core.draft_call(len(reqs)):
            if len(reqs) == 1:
                return [self._draft_call(reqs[0], left)]
            return self._draft_parts(reqs, left)

    def _draft_call(self, req: pb.DraftRequest, left: float) -> Drafted:
        if not self.config.stream:
            try:
                return Drafted(self._request("draft", req, left))
            except grpc.RpcError as exc:
                return Drafted(None, oversized=self._core.failed(exc))
        reply = self._stream("draft").call("draft", req, self.config.control_timeout_s)
        try:
            return Drafted(reply.result(timeout=left))
        except grpc.FutureTimeoutError:
            self._core.failed(None)
            return Drafted(None, reply)
        except grpc.RpcError as exc:
            return Drafted(None, oversized=self._core.failed(exc))

    def _draft_parts(self, reqs: list[pb.DraftRequest], left: float) -> list[Drafted]:
        """:meth:`_draft_call` for the parts of a batch, sent together: on the draft stream,
        one after another (the service answers them in order), or as unary calls at once;
        each reply awaited until the one deadline. A late part counts once for the step."""
        end = time.monotonic() + left
        if self.config.stream:
            stream = self._stream("draft")
            calls = [stream.call("draft", req, self.config.control_timeout_s) for req in reqs]
        else:
            calls = [self._stub.Draft.future(req, timeout=left, metadata=self.config.metadata) for req in reqs]
        out = []
        late = False
        for call in calls:
            try:  # a unary call ends by its own deadline
                wait = max(0.0, end - time.monotonic()) if self.config.stream else None
                out.append(Drafted(call.result(timeout=wait)))
            except grpc.FutureTimeoutError:
                late = True
                out.append(Drafted(None, call))
            except grpc.RpcError as exc:
                out.append(Drafted(None, oversized=self._core.failed(exc)))
        if late:
            self._core.failed(None)
        return out

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
        at the next call (a failed close ends the server copies without commit later). Where a
        session's open or a late draft call (on the stream) is still under way, the close is
        sent at a later call, once that one ended: the decoder never waits on the service here."""
        self._settle()
        self._check_late()
        self._core.ask_close(sessions, commit)
        self._reap()

    def commit(self, requests: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Add whole finished requests (prompt and output, decoded without this client's
        sessions: a near copy drafted for them) to the service's lifetime memory, in the
        background: each is opened with its tokens and closed with commit, and kept to send
        again while the service does not take it (see
        :class:`~decoder_client.client.commits.CommitBacklog`)."""
        for tokens in requests:
            self._core.keep_for_commit(np.asarray(tokens, dtype=np.int32).tolist(), retry=False)
        self._reopen([])

    def read_log(self, after: str, max_tokens: int) -> tuple[list[tuple[str, np.ndarray]], str]:
        """The namespace's lifetime log after the entry ``after`` (``""``: from its end now):
        entries of at most ``max_tokens`` tokens in all (at least one), oldest first, and the id
        the next read goes on after. A unary call within the control timeout; it raises
        ``grpc.RpcError`` (the caller retries later: nothing here waits on the service;
        FAILED_PRECONDITION: the namespace has another vocabulary or tokenizer than the config's)."""
        req = pb.ReadLogRequest(
            namespace=self.config.namespace,
            after=after,
            max_tokens=max_tokens,
            vocab_size=self.config.vocab_size,
            tokenizer=self.config.tokenizer,
        )
        resp = self._stub.ReadLog(req, timeout=self.config.control_timeout_s, metadata=self.config.metadata)
        return [(e.id, np.array(e.tokens, dtype=np.int32)) for e in resp.entries], resp.last

    def read_prior(self, version: int, offset: int, max_bytes: int) -> tuple[int, int, str, bytes]:
        """A page of the namespace's static prior as the service stores it: ``version`` (0: the
        current one, from offset 0), at most ``max_bytes`` from ``offset``; returns the version
        (0: the namespace has none), the blob's size and digest, and the page. A unary call
        within the control timeout; it raises ``grpc.RpcError`` (see
        :mod:`~decoder_client.client.prior_follow`)."""
        req = pb.ReadPriorRequest(
            namespace=self.config.namespace,
            version=version,
            offset=offset,
            max_bytes=max_bytes,
            vocab_size=self.config.vocab_size,
            tokenizer=self.config.tokenizer,
        )
        resp = self._stub.ReadPrior(req, timeout=self.config.control_timeout_s, metadata=self.config.metadata)
        return resp.version, resp.size, resp.digest, resp.data

    def settle(self) -> None:
        """Book the background calls that ended and carry on with the ended requests kept to
        commit (:class:`~decoder_client.client.commits.CommitBacklog`): a decoder with nothing
        to draft for a while (an idle engine) calls it now and then, so they do not wait for
        its next request."""
        self._check_late()
        self._reap()
        self._reopen([])

    def _reap(self, *, wait: bool = False) -> None:
        """Send the closes that can go (:meth:`_send_closes`), then book the background closes
        that ended (``wait``: all of them, each at most until its deadline)."""
        self._send_closes(now=wait)
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

    def _send_closes(self, *, now: bool = False) -> None:
        """Send, in the background, the closes that may go (``now``: all of them; see
        :meth:`ClientCore.closes_due`), an open that ended landed first."""
        if self._opening is not None and self._opening[1].done():
            self._land_opening(*self._opening)
        opening = [] if self._opening is None else self._opening[0].sessions
        for close in self._core.closes_due(opening, now=now):  # committing indexes the requests first
            self._closing.append((close, self._future("close", close, self.config.control_timeout_s)))

    def shutdown(self) -> None:
        """Settle calls in flight, close the server copies given up on, close the channel; once
        (a second call does nothing)."""
        if self._shut_down:
            return
        self._shut_down = True
        self._settle()
        self._check_late(None)
        self._land_reopen()
        self._reap(wait=True)
        self._commit_backlog()
        while (req := self._core.abandoned_request(now=True)) is not None:  # until one fails
            if self._call("close", req, self.config.control_timeout_s) is None:
                break
        for future in self._background:
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
                future.result(timeout=self.config.control_timeout_s)
        for stream in self._streams.values():
            stream.close(self.config.control_timeout_s)
        self._streams.clear()
        self._channel.close()

    def _land_reopen(self) -> None:
        """Let a re-open in flight land (its sessions get their copies, closed with them)."""
        if self._opening is not None:
            with contextlib.suppress(grpc.RpcError, grpc.FutureTimeoutError):
                self._opening[1].result(timeout=self.config.control_timeout_s)
            if self._opening[1].done():
                self._land_opening(*self._opening)

    def _open(self, sessions: Sequence[ClientSession]) -> None:
        """Open ``sessions`` and wait: in parts of at most ``max_batch`` sent at once, and
        those of a part the service refused for its size once more, in parts of the limit it
        named (see :meth:`ClientCore.failed`)."""
        for _ in range(2):
            parts = self._core.open_parts(sessions)
            calls = [(part, req, self._future("open", req, self.config.control_timeout_s)) for part, req in parts]
            opened = oversized = False
            for part, req, call in calls:
                try:
                    resp = call.result()
                except grpc.RpcError as exc:
                    oversized |= self._core.open_failed(req, exc)
                    continue
                self._core.opened(part, resp)
                opened = True
            if opened:
                self._close_abandoned()
            if not oversized:
                return

    def _reopen(self, sessions: Sequence[ClientSession]) -> None:
        """Sessions without a server copy (the service failed or restarted) are re-opened with
        their full context in the background, never inside a draft call's deadline (a long
        context takes a while to send and index): they draft locally until it is done."""
        if self._opening is not None:
            if not self._opening[1].done():
                return
            self._land_opening(*self._opening)
        opening = self._core.reopen_request(sessions)
        if opening is not None:
            self._opening = (opening, self._future("open", opening.request, self.config.control_timeout_s))

    def _land_opening(self, opening: Reopening, future: grpc.Future | StreamFuture) -> None:
        """Book the background open that ended."""
        self._opening = None
        try:
            self._core.opened(opening.sessions, future.result(), opening.sizes)
        except grpc.RpcError as exc:
            self._core.open_failed(opening.request, exc, opening.sessions)
            return
        self._close_abandoned()
        self._send_commits()

    def _send_commits(self) -> None:
        """Close with commit, in the background, the ended requests re-opened for it."""
        req = self._core.commit_request()
        if req is not None:
            self._closing.append((req, self._future("close", req, self.config.control_timeout_s)))

    def _commit_backlog(self) -> None:
        """At shutdown: one try (waited for) at committing the ended requests still kept, in
        parts (:data:`~decoder_client.client.core.BACKGROUND_BATCH`), until one fails."""
        for _ in range(parts(len(self._core.commits), self._core.background_batch)):
            opening = self._core.reopen_request([], now=True)
            if opening is None:
                break
            try:
                resp = self._request("open", opening.request, self.config.control_timeout_s)
            except grpc.RpcError as exc:
                self._core.open_failed(opening.request, exc, opening.sessions)
                break
            self._core.opened(opening.sessions, resp, opening.sizes)
            self._send_commits()
            self._reap(wait=True)
        left = self._core.commits.unsent
        if left:
            logger.warning("%d ended requests were never committed (the service did not take them)", left)

    def _close_abandoned(self) -> None:
        """Best effort, in the background: an unknown id (the server restarted) is fine too.
        The future is kept until done: gRPC cancels a call whose future is garbage-collected."""
        while (req := self._core.abandoned_request()) is not None:
            future = self._future("close", req, self.config.control_timeout_s)
            self._background = [f for f in self._background if not f.done()] + [future]

    def _stream(self, kind: str) -> Stream:
        """The live stream of ``kind``'s lane (another one when it broke)."""
        lane = lane_of(kind)
        stream = self._streams.get(lane)
        if stream is None or stream.error is not None:
            if stream is not None:
                stream.close(0)
            stream = self._streams[lane] = Stream(self._stub, self.config.metadata)
        return stream

    def _future(self, kind: str, req: Any, timeout: float) -> grpc.Future | StreamFuture:
        """A call under way: on its lane's stream, or unary."""
        if self.config.stream:
            return self._stream(kind).call(kind, req, timeout)
        return getattr(self._stub, UNARY[kind]).future(req, timeout=timeout, metadata=self.config.metadata)

    def _request(self, kind: str, req: Any, timeout: float) -> Any:
        """The reply within ``timeout``; raises the call's ``grpc.RpcError``."""
        if self.config.stream:
            return self._stream(kind).call(kind, req, timeout).result()
        return getattr(self._stub, UNARY[kind])(req, timeout=timeout, metadata=self.config.metadata)

    def _call(self, kind: str, req: Any, timeout: float) -> Any:
        """:meth:`_request`, or None when it failed (the service is then skipped a while)."""
        try:
            return self._request(kind, req, timeout)
        except grpc.RpcError as exc:
            self._core.failed(exc)
            return None

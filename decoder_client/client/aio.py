"""``AsyncDraftClient``: the client for a decoder on an asyncio loop (``grpc.aio`` calls and
:mod:`~decoder_client.client.aio_stream`'s streams)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, assert_never

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.client.aio_stream import AsyncStream, within
from decoder_client.client.config import RECONNECT_OPTIONS, ClientConfig
from decoder_client.client.core import ClientCore, ClientStats, Fallback, Reopening, parts, prompt_lookup_fallback
from decoder_client.client.plan import CatchUp, Draft, DraftAhead, Drafted, Effect, Reopen, draft_step
from decoder_client.client.protocol import UNARY, lane_of
from decoder_client.client.session import ClientSession, TopkRows
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)


class AsyncDraftClient:
    """The asyncio twin of :class:`DraftClient` (same bookkeeping, ``grpc.aio`` transport)."""

    def __init__(self, config: ClientConfig, fallback: Fallback = prompt_lookup_fallback) -> None:
        self._core = ClientCore(config, fallback)
        creds = config.credentials()
        self._channel = (
            grpc.aio.insecure_channel(config.target, options=RECONNECT_OPTIONS)
            if creds is None
            else grpc.aio.secure_channel(config.target, creds, options=RECONNECT_OPTIONS)
        )
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._streams: dict[str, AsyncStream] = {}  # by lane
        self._inflight: list[tuple[list[ClientSession], asyncio.Future]] = []  # drafting ahead
        self._opening: tuple[Reopening, asyncio.Future] | None = None
        self._background: set[asyncio.Future] = set()
        self._closing: set[asyncio.Future] = set()  # background closes (booked as each ends)
        self._shut_down = False

    @property
    def stats(self) -> ClientStats:
        return self._core.stats

    async def open(
        self, prompts: Sequence[Sequence[int] | np.ndarray], *, wait: bool = True, wait_s: float = 0.0
    ) -> list[ClientSession]:
        """See :meth:`DraftClient.open`."""
        sessions = [ClientSession(np.asarray(p, dtype=np.int32), len(p)) for p in prompts]
        if wait:
            await self._open(sessions)
        else:
            self._reopen(sessions)
            if wait_s > 0:
                await self._open_within(sessions, time.monotonic() + wait_s)
        return sessions

    async def _open_within(self, sessions: Sequence[ClientSession], end: float) -> None:
        """See :meth:`DraftClient._open_within`."""
        while self._opening is not None and not all(s.server_id for s in sessions):
            left = end - time.monotonic()
            if left <= 0:
                return
            opening, task = self._opening
            with contextlib.suppress(grpc.RpcError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), left)
            if not task.done():
                return
            self._land_opening(opening, task)
            self._reopen(sessions)

    async def draft(
        self,
        sessions: Sequence[ClientSession],
        new_tokens: Sequence[Sequence[int]],
        topk: Sequence[TopkRows | None] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> list[DraftTree]:
        """See :meth:`DraftClient.draft`. A task cancelled while it awaits the call leaves the
        call to go on (on a stream the service still applies it, unary perhaps): the sessions'
        server copies are in doubt, and re-opened with their full context, never sent a
        token twice."""
        step = draft_step(self._core, sessions, new_tokens, topk, deadline_s)
        drafted = None
        while True:
            try:
                effect = step.send(drafted)
            except StopIteration as done:
                return done.value
            try:
                drafted = await self._perform(effect)
            except asyncio.CancelledError:
                self._core.in_doubt(sessions)
                raise

    async def _perform(self, effect: Effect) -> list[Drafted] | None:
        """See :meth:`DraftClient._perform` (the asyncio client books its closes as each ends)."""
        match effect:
            case CatchUp(end):
                await self._settle(end)
                await self._check_late()
                self._send_closes()
            case Reopen(sessions):
                self._reopen(sessions)
            case Draft(reqs, left):
                return await self._draft(reqs, left)
            case DraftAhead(parts):
                timeout = self._core.config.control_timeout_s
                self._inflight = [(sessions, self._future("draft", req, timeout)) for sessions, req in parts]
            case _:  # every effect is handled above (mypy checks it)
                assert_never(effect)
        return None

    async def _settle(self, end: float | None = None) -> None:
        """See :meth:`DraftClient._settle`."""
        if not self._inflight:
            return
        inflight, self._inflight = self._inflight, []
        wait = self._core.config.deadline_s if end is None else max(0.0, end - time.monotonic())
        try:
            await asyncio.wait([task for _, task in inflight], timeout=wait)
        except asyncio.CancelledError:  # the calls go on unbooked: their copies are in doubt
            for sessions, task in inflight:
                _retrieve_later(task)
                self._core.in_doubt(sessions)
            raise
        late = []
        for sessions, task in inflight:
            if not task.done():
                late.append((sessions, task))
                continue
            resp = None
            if task.cancelled():
                pass
            elif (exc := task.exception()) is None:
                resp = task.result()
            elif not isinstance(exc, grpc.RpcError):
                raise exc
            elif self._core.failed(exc):  # refused for its size: it changed nothing
                continue
            self._core.answered(sessions, resp)
        if late:
            for task in self._core.ahead_late(late):
                task.cancel()

    async def _draft(self, reqs: list[pb.DraftRequest], left: float) -> list[Drafted]:
        """See :meth:`DraftClient._draft`."""
        with self._core.draft_call(len(reqs)):
            if len(reqs) == 1:
                return [await self._draft_call(reqs[0], left)]
            return await self._draft_parts(reqs, left)

    async def _draft_call(self, req: pb.DraftRequest, left: float) -> Drafted:
        cfg = self._core.config
        if not cfg.stream:
            try:
                return Drafted(await self._request("draft", req, left))
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one
                return Drafted(None, oversized=self._core.failed(exc))
        task = self._future("draft", req, cfg.control_timeout_s)
        try:
            return Drafted(await asyncio.wait_for(asyncio.shield(task), left))
        except TimeoutError:
            self._core.failed(None)
            return Drafted(None, task)
        except asyncio.CancelledError:  # see draft: the call goes on, nobody awaits it
            _retrieve_later(task)
            raise
        except grpc.RpcError as exc:
            return Drafted(None, oversized=self._core.failed(exc))

    async def _draft_parts(self, reqs: list[pb.DraftRequest], left: float) -> list[Drafted]:
        """See :meth:`DraftClient._draft_parts`."""
        cfg = self._core.config
        if cfg.stream:
            tasks = [self._future("draft", req, cfg.control_timeout_s) for req in reqs]
        else:  # each ends by its own deadline
            tasks = [asyncio.ensure_future(self._stub.Draft(req, timeout=left, metadata=cfg.metadata)) for req in reqs]
        try:
            await asyncio.wait(tasks, timeout=left if cfg.stream else None)
        except asyncio.CancelledError:  # see draft: the calls go on (a unary one is cancelled)
            for task in tasks:
                if not cfg.stream:
                    task.cancel()
                _retrieve_later(task)
            raise
        out = []
        late = False
        for task in tasks:
            if not task.done():
                late = True
                out.append(Drafted(None, task))
            elif (exc := task.exception()) is None:
                out.append(Drafted(task.result()))
            elif isinstance(exc, grpc.RpcError):
                out.append(Drafted(None, oversized=self._core.failed(exc)))
            else:
                raise exc
        if late:
            self._core.failed(None)
        return out

    async def _check_late(self, wait_for: Sequence[ClientSession] | None = ()) -> None:
        """See :meth:`DraftClient._check_late`."""
        due = self._core.due(wait_for)
        for i, (pairs, task) in enumerate(due):
            try:
                await asyncio.wait({task})  # at most until its deadline
            except asyncio.CancelledError:  # those not booked yet are booked at a later call
                self._core.late.extend(due[i:])
                raise
            if task.cancelled() or task.exception() is not None:
                self._core.late_failed(pairs)

    def add_tokens(self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]) -> None:
        """See :meth:`DraftClient.add_tokens`."""
        self._core.add_tokens(sessions, new_tokens)

    async def close(self, sessions: Sequence[ClientSession], *, commit: bool = True) -> None:
        """See :meth:`DraftClient.close`."""
        await self._settle()
        await self._check_late()
        self._core.ask_close(sessions, commit)
        self._send_closes()

    def _send_closes(self, *, now: bool = False) -> None:
        """See :meth:`DraftClient._send_closes`."""
        if self._opening is not None and self._opening[1].done():
            self._land_opening(*self._opening)
        opening = [] if self._opening is None else self._opening[0].sessions
        for close in self._core.closes_due(opening, now=now):
            self._send_close(close)

    def _send_close(self, req: pb.CloseSessionsRequest) -> None:
        task = self._future("close", req, self._core.config.control_timeout_s)
        task.add_done_callback(partial(self._closed, req))
        self._closing.add(task)

    async def settle(self) -> None:
        """See :meth:`DraftClient.settle`."""
        await self._check_late()
        self._send_closes()
        self._reopen([])

    def _closed(self, req: pb.CloseSessionsRequest, task: asyncio.Future) -> None:
        self._closing.discard(task)
        self._core.close_settled(req, asyncio.CancelledError() if task.cancelled() else task.exception())

    async def shutdown(self) -> None:
        """See :meth:`DraftClient.shutdown`."""
        if self._shut_down:
            return
        self._shut_down = True
        await self._settle()
        await self._check_late(None)
        await self._land_reopen()
        self._send_closes(now=True)
        await self._wait_closing()
        await self._commit_backlog()
        while (req := self._core.abandoned_request(now=True)) is not None:  # until one fails
            if await self._call("close", req, self._core.config.control_timeout_s) is None:
                break
        if self._background:
            await asyncio.wait(self._background, timeout=self._core.config.control_timeout_s)
        for stream in self._streams.values():
            await stream.close(self._core.config.control_timeout_s)
        self._streams.clear()
        await self._channel.close()

    async def _land_reopen(self) -> None:
        """See :meth:`DraftClient._land_reopen`."""
        if self._opening is not None:
            with contextlib.suppress(grpc.RpcError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._opening[1]), self._core.config.control_timeout_s)
            if self._opening[1].done():
                self._land_opening(*self._opening)

    def _reopen(self, sessions: Sequence[ClientSession]) -> None:
        """See :meth:`DraftClient._reopen`."""
        if self._opening is not None:
            if not self._opening[1].done():
                return
            self._land_opening(*self._opening)
        opening = self._core.reopen_request(sessions)
        if opening is not None:
            task = self._future("open", opening.request, self._core.config.control_timeout_s)
            self._opening = (opening, task)

    def _land_opening(self, opening: Reopening, task: asyncio.Future) -> None:
        """See :meth:`DraftClient._land_opening`."""
        self._opening = None
        exc = task.exception()
        if exc is None:
            self._core.opened(opening.sessions, task.result(), opening.sizes)
            self._close_abandoned()
            self._send_commits()
        elif isinstance(exc, grpc.RpcError):
            self._core.open_failed(opening.request, exc, opening.sessions)

    def _send_commits(self) -> None:
        """See :meth:`DraftClient._send_commits`."""
        req = self._core.commit_request()
        if req is not None:
            self._send_close(req)

    async def _commit_backlog(self) -> None:
        """See :meth:`DraftClient._commit_backlog`."""
        cfg = self._core.config
        for _ in range(parts(len(self._core.commits), self._core.background_batch)):
            opening = self._core.reopen_request([], now=True)
            if opening is None:
                break
            try:
                resp = await self._request("open", opening.request, cfg.control_timeout_s)
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one
                self._core.open_failed(opening.request, exc, opening.sessions)
                break
            self._core.opened(opening.sessions, resp, opening.sizes)
            self._send_commits()
            await self._wait_closing()
        left = self._core.commits.unsent
        if left:
            logger.warning("%d ended requests were never committed (the service did not take them)", left)

    async def _wait_closing(self) -> None:
        """Book every background close, each given at most the control timeout."""
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=self._core.config.control_timeout_s)
            for task in list(self._closing):  # still not answered: given up on
                task.cancel()
            await asyncio.sleep(0)  # their callbacks book them

    async def _open(self, sessions: Sequence[ClientSession]) -> None:
        """See :meth:`DraftClient._open`."""
        for _ in range(2):
            parts = self._core.open_parts(sessions)
            if not parts:
                return
            tasks = [self._future("open", req, self._core.config.control_timeout_s) for _, req in parts]
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:  # the service may have made them: closed once it answers
                for (_, req), task in zip(parts, tasks, strict=True):
                    task.cancel()
                    _retrieve_later(task)
                    self._core.abandon(s.session_id for s in req.sessions)
                raise
            opened = oversized = False
            for (part, req), task in zip(parts, tasks, strict=True):
                if (exc := task.exception()) is None:
                    self._core.opened(part, task.result())
                    opened = True
                elif isinstance(exc, grpc.RpcError):  # grpc.aio.AioRpcError is one
                    oversized |= self._core.open_failed(req, exc)
                else:
                    raise exc
            if opened:
                self._close_abandoned()
            if not oversized:
                return

    def _close_abandoned(self) -> None:
        """Best effort, not awaited: an unknown id (the server restarted) is fine too."""
        while (abandoned := self._core.abandoned_request()) is not None:
            task = self._future("close", abandoned, self._core.config.control_timeout_s)
            _retrieve_later(task)  # failures are fine
            self._background = {t for t in self._background if not t.done()} | {task}

    def _stream(self, kind: str) -> AsyncStream:
        """See :meth:`DraftClient._stream`."""
        lane = lane_of(kind)
        stream = self._streams.get(lane)
        if stream is None or stream.error is not None:
            if stream is not None:
                stream.cancel()
            stream = self._streams[lane] = AsyncStream(self._stub, self._core.config.metadata)
        return stream

    def _future(self, kind: str, req: Any, timeout: float) -> asyncio.Future:
        """A call under way (a task that raises the call's ``grpc.RpcError``)."""
        cfg = self._core.config
        if cfg.stream:
            stream = self._stream(kind)
            return asyncio.ensure_future(within(stream, stream.call(kind, req), timeout))
        return asyncio.ensure_future(getattr(self._stub, UNARY[kind])(req, timeout=timeout, metadata=cfg.metadata))

    async def _request(self, kind: str, req: Any, timeout: float) -> Any:
        cfg = self._core.config
        if cfg.stream:
            stream = self._stream(kind)
            return await within(stream, stream.call(kind, req), timeout)
        return await getattr(self._stub, UNARY[kind])(req, timeout=timeout, metadata=cfg.metadata)

    async def _call(self, kind: str, req: Any, timeout: float) -> Any:
        try:
            return await self._request(kind, req, timeout)
        except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one
            self._core.failed(exc)
            return None


def _retrieve_later(task: asyncio.Future) -> None:
    """A call nobody awaits any more: its outcome is read when it ends (asyncio would log an
    error it ended with as never retrieved)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())

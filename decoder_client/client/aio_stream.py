"""The asyncio transport: the twin of :mod:`decoder_client.client.stream` on ``grpc.aio``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import grpc
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.client.protocol import Late, RequestFailed, StreamEnded, reply_body


class AsyncStream:
    """The asyncio twin of ``stream.Stream``: a writer task sends requests in order, a reader
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
            self._broken(exc if isinstance(exc, grpc.RpcError) else StreamEnded())

    async def _read(self) -> None:
        error: grpc.RpcError = StreamEnded()
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                reply, kind = self._waiting.pop(msg.request_id, (None, ""))
                if reply is not None and not reply.done():
                    try:
                        reply.set_result(reply_body(msg, kind))
                    except RequestFailed as exc:
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
        """See ``stream.Stream.stall``."""
        self._broken(Late())
        self.cancel()


async def within(stream: AsyncStream, reply: asyncio.Future[Any], timeout: float) -> Any:
    """A stream reply, or DEADLINE_EXCEEDED past ``timeout`` (as a unary call would; the
    stream is then replaced, see ``stream.Stream.stall``)."""
    try:
        return await asyncio.wait_for(reply, timeout)
    except TimeoutError:
        stream.stall()
        raise Late() from None

"""The threaded transport: requests on one bidirectional stream, their replies matched by id."""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from typing import Any

import grpc
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.client.protocol import Late, RequestFailed, StreamEnded, reply_body


class StreamFuture:
    """One request's reply on a :class:`Stream`, with a unary call future's interface:
    ``result(timeout)`` raises ``grpc.FutureTimeoutError`` past ``timeout``, DEADLINE_EXCEEDED
    past the request's own deadline and the stream's status if the stream broke; ``done`` is
    true from the deadline on; ``cancel`` forgets the request (a late reply is dropped)."""

    def __init__(self, stream: Stream, request_id: int, kind: str, deadline: float) -> None:
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
            raise Late() from None

    def done(self) -> bool:
        return self.future.done() or time.monotonic() >= self._deadline

    def cancel(self) -> bool:
        self._stream.forget(self.request_id)
        return True


class Stream:
    """Requests on one bidirectional stream, answered in order by the service. A reader thread
    matches replies to requests by id; when the stream breaks, every request in flight fails
    with its status and ``error`` tells the owner to start another."""

    def __init__(self, stub: pb_grpc.DraftCacheStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._out: queue.SimpleQueue[pb.StreamRequest | None] = queue.SimpleQueue()
        self._waiting: dict[int, StreamFuture] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.error: grpc.RpcError | None = None
        self._call = stub.Stream(iter(self._out.get, None), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="draftcache-stream", daemon=True)
        self._reader.start()

    def call(self, kind: str, request: Any, timeout: float) -> StreamFuture:
        reply = StreamFuture(self, next(self._ids), kind, time.monotonic() + timeout)
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
            self.error = self.error or Late()
        self._call.cancel()

    def _read(self) -> None:
        error: grpc.RpcError = StreamEnded()
        try:
            for msg in self._call:
                with self._lock:
                    reply = self._waiting.pop(msg.request_id, None)
                if reply is not None:
                    try:
                        reply.future.set_result(reply_body(msg, reply.kind))
                    except RequestFailed as exc:
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

"""Where each kind of call travels, and how a request on a stream ends: what the threaded and
the asyncio transports share.

A request on a stream fails with a ``grpc.RpcError`` carrying the status a unary call would
have ended with, so the clients book both transports' failures alike.
"""

from __future__ import annotations

from typing import Any

import grpc
from draftcache.v1 import draftcache_pb2 as pb

UNARY = {"open": "OpenSessions", "draft": "Draft", "close": "CloseSessions"}  # method per kind


def lane_of(kind: str) -> str:
    """Drafts have a stream to themselves; opens and closes share the other.

    >>> lane_of("draft"), lane_of("open"), lane_of("close")
    ('draft', 'control', 'control')
    """
    return "draft" if kind == "draft" else "control"


class StreamEnded(grpc.RpcError):
    """The service ended a stream without a status (it is replaced at the next call)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "stream ended"


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class RequestFailed(grpc.RpcError):
    """A request the service answered on a stream with an error status (the stream goes on)."""

    def __init__(self, error: pb.StreamError) -> None:
        super().__init__(error.message)
        self._code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
        self._details = error.message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Late(grpc.RpcError):
    """A request on a stream past its deadline: what a unary call reports as DEADLINE_EXCEEDED."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "deadline exceeded"


def reply_body(msg: pb.StreamResponse, kind: str) -> Any:
    """The body a stream reply carries for a request of ``kind``; raises its error status."""
    if msg.WhichOneof("body") == "error":
        raise RequestFailed(msg.error)
    return getattr(msg, kind)

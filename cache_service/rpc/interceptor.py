"""The one place where domain errors become gRPC status codes.

Only the errors a client can be told about (:mod:`cache_service.domain.errors`, and storage
trouble) get a code of their own; anything else is a bug in the service and ends as INTERNAL
with its traceback logged, never passed off as the caller's mistake.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cache_service.domain import errors
from cache_service.rpc import wire
from cache_service.storage import errors as storage_errors

logger = logging.getLogger(__name__)

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (storage_errors.StorageUnavailable, grpc.StatusCode.UNAVAILABLE),
    (storage_errors.SchemaMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (storage_errors.NamespaceConflict, grpc.StatusCode.ALREADY_EXISTS),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The code and message a call that raised ``exc`` ends with; INTERNAL ones are logged."""
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("internal error in %s", method, exc_info=exc)
        return code, f"internal error ({type(exc).__name__})"
    return code, str(exc)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    await context.abort(*status_of(exc, method))


Observer = Callable[[str, str, float], None]  # (method, status code name, seconds)


class MalformedRequest(errors.InvalidArgument):
    """Bytes that do not parse as the method's request message."""


def _parsed(parse: Callable[[Any], Any], raw: Any) -> Any:
    try:
        return parse(raw)
    except DecodeError as exc:
        raise MalformedRequest(f"malformed request: {exc}") from exc


async def _parsed_stream(parse: Callable[[Any], Any], raw: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in raw:
        yield _parsed(parse, item)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a handler to status codes; INTERNAL ones are logged with
    traceback. With ``observe``, every call's outcome and duration are reported to it."""

    def __init__(self, observe: Observer | None = None) -> None:
        self._observe = observe

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        parse = handler.request_deserializer or (lambda raw: raw)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(raw: Any, context: grpc.aio.ServicerContext) -> Any:
                # Each outcome is reported before the caller can see it (a scrape right after a
                # call counts it).
                began = time.perf_counter()
                try:
                    response = await inner(_parsed(parse, raw), context)
                except asyncio.CancelledError:
                    self._report(method, "CANCELLED", began)
                    raise
                except grpc.aio.AbortError:
                    self._report(method, "ABORTED_BY_HANDLER", began)
                    raise
                except Exception as exc:
                    self._report(method, status_for(exc).name, began)
                    failed = status_of(exc, method)
                else:
                    self._report(method, "OK", began)
                    return response
                # Aborted outside the except block: the abort's error does not chain the handler's,
                # whose traceback holds the request's frames. Chained, they formed a cycle through
                # the call's context that only the cyclic collector (run rarely here) freed, so
                # every refused request, parsed whole, stayed in memory until then.
                await context.abort(*failed)

            # Requests arrive as bytes and are parsed inside, so corrupt ones are refused clearly.
            return grpc.unary_unary_rpc_method_handler(unary, None, wire.serializer(handler.response_serializer))
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for response in inner_stream(_parsed_stream(parse, requests), context):
                        yield response
                except Exception as exc:
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await _abort(context, exc, method)

            return grpc.stream_stream_rpc_method_handler(stream, None, wire.serializer(handler.response_serializer))
        return handler

    def _report(self, method: str, code: str, began: float) -> None:
        if self._observe is not None:
            self._observe(method, code, time.perf_counter() - began)

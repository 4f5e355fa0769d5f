"""gRPC servicers: proto in, domain call, proto out. No logic lives here.

Each call's batch size (and a columnar draft's shape) is admitted before the request is turned
into domain items or arrays, and before storage is asked about any session it names: a call
over the limits costs the service next to nothing.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, TypeVar

import grpc
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.domain.errors import InvalidArgument, Unavailable
from cache_service.domain.items import named_sessions
from cache_service.domain.ports import StorageHealth
from cache_service.domain.service import DraftService
from cache_service.rpc import auth, convert, wire
from cache_service.rpc.interceptor import Observer, status_of

# An open call whose prompts hold at least this many tokens in all has them indexed on a worker
# thread (a 128k-token prompt takes ~7 ms, which would stall every other call); shorter ones are
# indexed at once, cheaper than handing them over.
OFF_LOOP_TOKENS = 2048
T = TypeVar("T")
# Threads for the storage reads calls wait on (stored sessions, log and prior pages), apart from
# those that run commits: however many reads a hung storage holds (each for the storage call
# timeout), a close's commit still runs at once, and is journaled if storage does not take it.
STORAGE_READ_THREADS = 8
COMMIT_THREADS = 4


def _run_in_order(jobs: list[Callable[[], None]]) -> None:
    """A close's jobs, one after another, on the thread that runs them (the first that raises
    stops the rest, and its error is the call's)."""
    for job in jobs:
        job()


class DraftCacheServicer(pb_grpc.DraftCacheServicer):
    def __init__(self, service: DraftService, observe: Observer | None = None) -> None:
        self._service = service
        self._observe = observe  # stream messages are timed one by one (the call is long-lived)
        self._streams: dict[asyncio.Task, bool] = {}  # open streams: is each waiting for a message
        self._draining = False
        self._reads = ThreadPoolExecutor(STORAGE_READ_THREADS, thread_name_prefix="storage-read")
        self._commits = ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="commit")
        wire.warm_up()  # the response encoder is compiled now, not on the first draft

    async def _read(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on a storage-read thread (the call's context, its principal, goes along)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._reads, call)

    def drain(self) -> None:
        """Shutting down: end every stream, those waiting for a message now, the others once
        their message is answered; the client starts another stream elsewhere or falls back.
        Without this, a stream held open by an idle client would last the whole grace period."""
        self._draining = True
        for task, waiting in self._streams.items():
            if waiting:
                task.cancel()

    async def OpenSessions(
        self, request: pb.OpenSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenSessionsResponse:
        self._service.admission.batch(len(request.sessions))  # before anything sized by the request
        items = convert.open_items(request, self._service.config.default_params)
        to_read = self._service.open_ids_to_read(items)
        try:
            stored = await self._read(self._service.read_stored, to_read, build=False) if to_read else {}
        except Unavailable:  # storage down: opened all the same, unchecked (see prepare_open)
            opening = self._service.prepare_open(items, principal=auth.current(), unchecked=True)
        else:
            opening = self._service.prepare_open(items, principal=auth.current(), stored=stored)
        sessions = None  # built here, at once
        if opening.prompt_tokens >= OFF_LOOP_TOKENS:
            sessions = await asyncio.to_thread(self._service.build_sessions, opening)
        return pb.OpenSessionsResponse(session_ids=self._service.finish_open(opening, sessions))

    async def Draft(self, request: pb.DraftRequest, context: grpc.aio.ServicerContext) -> wire.Encoded:
        convert.admit_draft(request, self._service.admission)
        items, principal = convert.draft_items(request), auth.current()
        await self._continue_stored(named_sessions(items), principal)
        return convert.draft_response(self._service.draft_ahead(items, principal=principal, read_storage=False))

    async def Feedback(self, request: pb.FeedbackRequest, context: grpc.aio.ServicerContext) -> pb.FeedbackResponse:
        convert.admit_feedback(request, self._service.admission)
        items, principal = convert.feedback_items(request), auth.current()
        await self._continue_stored([item.session_id for item in items], principal)
        self._service.feedback(items, principal=principal, read_storage=False)
        return pb.FeedbackResponse()

    async def CloseSessions(
        self, request: pb.CloseSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionsResponse:
        self._service.admission.batch(len(request.sessions))
        items, principal = convert.close_items(request), auth.current()
        await self._continue_stored([item.session_id for item in items], principal)
        jobs = self._service.close(items, principal=principal, read_storage=False)
        if jobs:  # off the event loop, in order, in one task: a caller that gives up stops none of them
            await asyncio.get_running_loop().run_in_executor(self._commits, _run_in_order, jobs)
        return pb.CloseSessionsResponse()  # after them: the commits are durable and visible

    async def Echo(self, request: pb.EchoRequest, context: grpc.aio.ServicerContext) -> pb.EchoResponse:
        return pb.EchoResponse(payload=request.payload)

    async def ReadLog(self, request: pb.ReadLogRequest, context: grpc.aio.ServicerContext) -> pb.ReadLogResponse:
        principal = auth.current()
        # Storage is read on a worker thread: a slow storage holds only this call.
        entries, last = await self._read(
            self._service.read_log,
            request.namespace,
            request.after,
            request.max_tokens,
            principal=principal,
            vocab_size=request.vocab_size,
            tokenizer=request.tokenizer,
        )
        return pb.ReadLogResponse(entries=[pb.LogEntry(id=i, tokens=t.tolist()) for i, t in entries], last=last)

    async def ReadPrior(self, request: pb.ReadPriorRequest, context: grpc.aio.ServicerContext) -> pb.ReadPriorResponse:
        principal = auth.current()
        page = await self._read(  # storage on a worker thread, as ReadLog
            self._service.read_prior,
            request.namespace,
            request.version,
            request.offset,
            request.max_bytes,
            principal=principal,
            vocab_size=request.vocab_size,
            tokenizer=request.tokenizer,
        )
        return pb.ReadPriorResponse(version=page.version, size=page.size, digest=page.digest, data=page.data)

    async def _continue_stored(self, sids: Sequence[str], principal: auth.Principal | None) -> None:
        """Sessions this replica does not hold are read from storage on a worker thread: a slow
        storage delays the calls naming them, never the event loop serving everyone else."""
        missing = self._service.not_in_memory(sids)
        if missing:
            found = await self._read(self._service.read_stored, missing)
            self._service.continue_stored(found, principal=principal)

    async def _one(
        self, req: pb.StreamRequest, kind: str | None, context: grpc.aio.ServicerContext
    ) -> pb.StreamResponse | wire.Encoded:
        """One stream request's answer."""
        rid = req.request_id
        if kind == "draft":  # sent as encoded, never parsed into a message here
            return wire.stream_draft(rid, (await self.Draft(req.draft, context)).data)
        if kind == "open":
            return pb.StreamResponse(request_id=rid, open=await self.OpenSessions(req.open, context))
        if kind == "feedback":
            return pb.StreamResponse(request_id=rid, feedback=await self.Feedback(req.feedback, context))
        if kind == "close":
            return pb.StreamResponse(request_id=rid, close=await self.CloseSessions(req.close, context))
        raise InvalidArgument("stream message without a body")

    async def Stream(
        self, request_iterator: AsyncIterator[pb.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamResponse | wire.Encoded]:
        task = asyncio.current_task()
        if task is None or self._draining:
            return
        self._streams[task] = True
        try:
            async for req in request_iterator:
                self._streams[task] = False
                kind = req.WhichOneof("body")
                began, code = time.perf_counter(), grpc.StatusCode.OK
                try:
                    resp = await self._one(req, kind, context)
                except Exception as exc:  # this request fails; the stream goes on
                    code, message = status_of(exc, f"Stream.{kind}")
                    resp = pb.StreamResponse(
                        request_id=req.request_id, error=pb.StreamError(code=code.value[0], message=message)
                    )
                if self._observe is not None:
                    self._observe(f"Stream.{kind}", code.name, time.perf_counter() - began)
                yield resp
                if self._draining:
                    return
                self._streams[task] = True
        except asyncio.CancelledError:
            if not self._draining:
                raise
            # drain() interrupted the wait for a message: end the stream with OK (a cancelled
            # handler would leave the call open until the grace period ends)
        finally:
            self._streams.pop(task, None)


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, service: DraftService, storage_health: Callable[[], StorageHealth] | None = None) -> None:
        self._service = service
        self._storage_health = storage_health

    async def CreateNamespace(
        self, request: pb.CreateNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateNamespaceResponse:
        principal = auth.current()
        # Registering writes to storage: on a worker thread, so a slow storage holds only this call.
        await asyncio.to_thread(
            self._service.create_namespace,
            request.name,
            request.vocab_size,
            principal=principal,
            tokenizer=request.tokenizer,
        )
        (stats,) = self._service.stats(request.name, principal=principal)
        return pb.CreateNamespaceResponse(namespace=convert.namespace_info(stats))

    async def Namespaces(
        self, request: pb.NamespacesRequest, context: grpc.aio.ServicerContext
    ) -> pb.NamespacesResponse:
        stats = self._service.stats(principal=auth.current())
        return pb.NamespacesResponse(namespaces=[convert.namespace_info(s) for s in stats])

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = self._service.stats(request.namespace, principal=auth.current())
        return pb.StatsResponse(
            namespaces=[convert.namespace_info(s) for s in stats],
            sessions=sum(s.sessions for s in stats),
            drafts=self._service.drafts,
            pending_writes=self._service.pending_writes,
            storage=None if self._storage_health is None else pb.StorageHealth(**asdict(self._storage_health())),
        )

    async def DeleteNamespace(
        self, request: pb.DeleteNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteNamespaceResponse:
        principal = auth.current()
        # Storage first, on a worker thread (a slow storage holds only this call); then this
        # replica's sessions and drafter, on the serving thread.
        registered = await asyncio.to_thread(self._service.unregister_namespace, request.name, principal=principal)
        closed = self._service.drop_namespace(request.name, registered=registered)
        return pb.DeleteNamespaceResponse(sessions_closed=closed)

    async def Rebuild(self, request: pb.RebuildRequest, context: grpc.aio.ServicerContext) -> pb.RebuildResponse:
        principal = auth.current()
        stats = await asyncio.to_thread(self._service.rebuild, request.namespace, principal=principal)
        return pb.RebuildResponse(namespaces=[convert.namespace_info(s) for s in stats])

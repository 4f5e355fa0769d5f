"""Round-trip benchmark against a running service: a draft over the bidirectional stream
(batch 1 and batch N) beside an empty echo RPC carrying the same number of bytes."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from benchmarks.traces import Conversation


class StreamCaller:
    """Request/response over one bidi stream, one message in flight at a time."""

    def __init__(self, stub: pb_grpc.DraftCacheStub) -> None:
        self._out: queue.Queue[pb.StreamRequest | None] = queue.Queue()
        self._responses = stub.Stream(self._requests())
        self._next_id = 0

    def _requests(self) -> Iterator[pb.StreamRequest]:
        while (msg := self._out.get()) is not None:
            yield msg

    def draft(self, items: list[pb.DraftItem]) -> pb.DraftResponse:
        self._next_id += 1
        self._out.put(pb.StreamRequest(request_id=self._next_id, draft=pb.DraftRequest(items=items)))
        return next(self._responses).draft

    def close(self) -> None:
        self._out.put(None)


def _percentiles(samples: list[float]) -> dict[str, float]:
    arr = np.array(samples) * 1e3
    return {"p50_ms": round(float(np.percentile(arr, 50)), 3), "p99_ms": round(float(np.percentile(arr, 99)), 3)}


def run_rpc_bench(
    target: str,
    namespace: str,
    conversations: list[Conversation],
    *,
    steps: int,
    batch: int,
    during_rebuild: bool = False,
) -> dict:
    """Interleave echo and stream-draft calls (so both see the same machine state). With
    ``during_rebuild`` the same measurement runs again while another client asks the service to
    rebuild its indexes back to back, and the report compares the two."""
    idle = _measure(target, namespace, conversations, steps=steps, batch=batch)
    if not during_rebuild:
        return idle
    stop = threading.Event()
    rebuilds: list[float] = []
    worker = threading.Thread(target=_rebuild_loop, args=(target, namespace, stop, rebuilds), daemon=True)
    worker.start()
    try:
        busy = _measure(target, namespace, conversations, steps=steps, batch=batch)
    finally:
        stop.set()
        worker.join()
    key = "draft_stream_batch1"
    return {
        "idle": idle,
        "during_rebuild": busy,
        "rebuilds": len(rebuilds),
        "rebuild_s_median": round(float(np.median(rebuilds)), 3) if rebuilds else None,
        "draft_p99_rebuild_over_idle": round(busy[key]["p99_ms"] / idle[key]["p99_ms"], 3),
        "echo_p99_rebuild_over_idle": round(busy["echo_unary"]["p99_ms"] / idle["echo_unary"]["p99_ms"], 3),
    }


def _rebuild_loop(target: str, namespace: str, stop: threading.Event, seconds: list[float]) -> None:
    with grpc.insecure_channel(target) as channel:
        admin = pb_grpc.AdminStub(channel)
        while not stop.is_set():
            start = time.perf_counter()
            admin.Rebuild(pb.RebuildRequest(namespace=namespace), timeout=600)
            seconds.append(time.perf_counter() - start)


def _measure(target: str, namespace: str, conversations: list[Conversation], *, steps: int, batch: int) -> dict:
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.DraftCacheStub(channel)
    prompts = [np.concatenate([s.tokens for s in c.segments]) for c in conversations]
    sessions = [
        stub.OpenSessions(
            pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=namespace, prompt=p[:-64].tolist())])
        ).session_ids[0]
        for p in prompts[:batch]
    ]
    stream = StreamCaller(stub)
    echo, draft1, draftn, size = [], [], [], 0
    lock = threading.Lock()
    for step in range(steps):
        tok = [[int(p[-64 + step % 64])] for p in prompts[:batch]]
        t0 = time.perf_counter()
        resp = stream.draft([pb.DraftItem(session_id=sessions[0], new_tokens=tok[0])])
        draft1.append(time.perf_counter() - t0)
        size = max(size, resp.ByteSize())
        payload = b"\0" * size
        t0 = time.perf_counter()
        stub.Echo(pb.EchoRequest(payload=payload))
        echo.append(time.perf_counter() - t0)
        if batch > 1:
            items = [pb.DraftItem(session_id=s, new_tokens=t) for s, t in zip(sessions, tok, strict=True)]
            t0 = time.perf_counter()
            stream.draft(items)
            with lock:
                draftn.append(time.perf_counter() - t0)
    stream.close()
    stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=s) for s in sessions]))
    channel.close()
    out = {
        "echo_unary": _percentiles(echo),
        "draft_stream_batch1": _percentiles(draft1),
        "draft_over_echo_p50": round(float(np.median(draft1) / np.median(echo)), 3),
        "response_bytes": size,
    }
    if draftn:
        out[f"draft_stream_batch{batch}"] = _percentiles(draftn)
        out["sequence_drafts_per_s"] = round(batch / float(np.median(draftn)), 1)
    return out

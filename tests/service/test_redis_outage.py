"""Redis killed (SIGKILL) under load and restarted: drafts keep flowing from memory, commits
acknowledged during the outage are queued (and reported) and reach the lifetime log when Redis
returns. Tokens lost: zero."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.app import App, AppConfig, connect
from cache_service.config import ServerConfig, ServiceConfig
from cache_service.domain.errors import Unavailable
from cache_service.domain.service import DraftService
from cache_service.host.embedded_redis import find_server_binary, free_port
from cache_service.persistence import RedisPersistence
from cache_service.storage.connect import connect_for_calls
from cache_service.storage.redis_store import RedisStore
from tests.service.conftest import eventually


class Redis:
    """A redis-server on a fixed port with an fsync-always AOF, killable and restartable."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [str(find_server_binary()), "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--dir", str(self.workdir), "--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if connect(self.url).ping():
                    return
            except Exception:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def app_on_redis(
    tmp_path: Path, service: ServiceConfig | None = None, **config: Any
) -> Iterator[tuple[App, Redis, int, asyncio.AbstractEventLoop]]:
    """An :class:`App` (``service``, other ``AppConfig`` fields in ``config``) on a fresh
    :class:`Redis`, serving from an event loop on a thread of its own; yields it, the Redis, its
    port and the loop. After: Redis started again if it was left down (the App then stops as it
    would in production), the App stopped, Redis killed."""
    redis = Redis(tmp_path)
    redis.start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    app = App(
        AppConfig(
            service=service or ServiceConfig(),
            server=ServerConfig(port=0),
            redis_url=redis.url,
            journal_dir=tmp_path / "j",
            **config,
        )
    )
    try:
        port = asyncio.run_coroutine_threadsafe(app.start(), loop).result(60)
        try:
            yield app, redis, port, loop
        finally:
            if redis.proc is None or redis.proc.poll() is not None:
                redis.start()
            asyncio.run_coroutine_threadsafe(app.stop(), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        redis.kill()


def logged_requests(url: str, ns: str) -> list[list[int]]:
    """Every request in the namespace's lifetime log, oldest first."""
    store = RedisStore(connect(url))
    logged, last = [], "0"
    while entries := store.read_log(ns, after_id=last):
        logged += [e.tokens.tolist() for e in entries]
        last = entries[-1].id
    return logged


def _request_tokens(i: int) -> list[int]:
    rng = np.random.default_rng(i)
    return [*rng.integers(0, 900, 24).tolist(), 900 + i % 90]  # distinct per request


def test_redis_killed_under_load_loses_no_acknowledged_commit(tmp_path: Path) -> None:
    service = ServiceConfig(follow_interval_s=0.1, flush_interval_s=0.2)
    with app_on_redis(tmp_path, service) as (app, redis, port, _):
        stub = pb_grpc.DraftCacheStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{port}")).CreateNamespace(
            pb.CreateNamespaceRequest(name="ns", vocab_size=1000)
        )
        acked: list[list[int]] = []
        drafts_during_outage = 0
        pending_seen = 0
        down = threading.Event()

        def one_request(i: int) -> None:
            nonlocal drafts_during_outage
            tokens = _request_tokens(i)
            req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns", prompt=tokens[:8])])
            sid = stub.OpenSessions(req, timeout=10).session_ids[0]
            for k in range(8, len(tokens), 4):
                item = pb.DraftItem(session_id=sid, new_tokens=tokens[k : k + 4])
                stub.Draft(pb.DraftRequest(items=[item]), timeout=10)
                drafts_during_outage += down.is_set()
            close = pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)])
            stub.CloseSessions(close, timeout=10)  # answered: acknowledged
            acked.append(tokens)

        for i in range(20):
            one_request(i)
        redis.kill()
        down.set()
        for i in range(20, 50):  # the service keeps drafting and acknowledging from memory
            one_request(i)
        pending_seen = app.service.pending_writes
        down.clear()
        redis.start()
        deadline = time.monotonic() + 30
        while app.service.pending_writes and time.monotonic() < deadline:
            time.sleep(0.1)
        assert app.service.pending_writes == 0
        # Every acknowledged request is in the lifetime log, once.
        logged = logged_requests(redis.url, "ns")
        lost = [t for t in acked if t not in logged]
        assert len(acked) == 50 and not lost
        assert sorted(map(tuple, logged)) == sorted(map(tuple, acked))  # and nothing twice
        assert drafts_during_outage == 30 * 5 and pending_seen > 0


def test_a_namespace_storage_could_not_register_is_not_served_and_a_retry_registers_it(tmp_path: Path) -> None:
    """CreateNamespace while Redis is down answers UNAVAILABLE and leaves nothing behind; the
    same call once Redis is back registers it (it was not taken for one that exists)."""
    redis = Redis(tmp_path)
    redis.start()
    store = RedisStore(connect_for_calls(redis.url, 0.5))
    service = DraftService(ServiceConfig(), RedisPersistence(store, max_pending=10))
    try:
        redis.kill()
        with pytest.raises(Unavailable):
            service.create_namespace("ns", 100)
        assert service.namespace_names() == []
        redis.start()
        service.create_namespace("ns", 100)
        assert service.namespace_names() == ["ns"] and store.namespaces() == {"ns": 100}
        service.create_namespace("ns", 100)  # again: it exists, and stays registered
        assert store.namespaces() == {"ns": 100}
    finally:
        redis.kill()


def test_a_close_its_caller_gave_up_on_still_commits_every_namespace_it_names(tmp_path: Path) -> None:
    """A close naming sessions of two namespaces commits them one after the other. Redis frozen,
    the first waits out the storage call timeout (1 s) before it is journaled, and the caller
    gives up at 0.3 s. The second is journaled all the same, and both reach the log once Redis
    is back (the caller's giving up stopped the jobs still to run: the second request, its
    session closed, was lost to the service)."""
    service = ServiceConfig(follow_interval_s=3600, flush_interval_s=3600)  # no job touches storage
    with app_on_redis(tmp_path, service, call_timeout_s=1.0) as (app, redis, port, _):
        for ns in ("a", "b"):
            app.service.create_namespace(ns, 1000)
        stub = pb_grpc.DraftCacheStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        tokens = _request_tokens(0)
        opens = [pb.OpenSession(namespace=ns, prompt=tokens) for ns in ("a", "b")]
        sids = stub.OpenSessions(pb.OpenSessionsRequest(sessions=opens), timeout=10).session_ids
        close = pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True) for sid in sids])
        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as err:
                stub.CloseSessions(close, timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            eventually(lambda: app.persistence.pending == 2)
        finally:
            redis.proc.send_signal(signal.SIGCONT)
        app.persistence.flush()
        assert logged_requests(redis.url, "a") == [tokens] == logged_requests(redis.url, "b")

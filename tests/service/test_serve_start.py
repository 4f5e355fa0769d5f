"""``draftcache serve`` that cannot start: it says why in one line, and leaves nothing running;
a second service on a data folder in use leaves the first one's Redis alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from cache_service.host.embedded_redis import free_port, runs_server
from tests.faults import Serve

START_S = 120.0  # a first start may compile the drafting loops


def _servers_on(data: Path) -> list[int]:
    """Live Redis-compatible servers whose data folder (their working directory: a server
    retitles its command line) is under ``data``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                alive = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                folder = Path(os.readlink(entry / "cwd"))
            except OSError:
                continue
            if alive and runs_server(cmdline) and folder.is_relative_to(data.resolve()):
                found.append(int(entry.name))
    return found


def _serve(data: Path, port: int, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cache_service.cli", "serve", "--port", str(port), "--data-dir", str(data), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=START_S)


def test_a_second_service_on_the_same_data_refuses_and_leaves_the_first_alone(tmp_path: Path) -> None:
    with Serve(tmp_path / "data") as first:
        redis = first.redis_pid()
        second = _serve(tmp_path / "data", free_port())
        assert second.returncode == 2, second.stderr
        assert "in use by another draftcache service" in second.stderr
        assert _servers_on(tmp_path / "data") == [redis]  # the first one's, running on
        assert first.redis_pid() == redis
        assert first.stats().storage.available


def test_a_bad_token_file_stops_the_start_before_anything_runs(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": "t", "tenant": "a"}], "limits": {"a": {"max_sesions": 5}}}))
    done = _serve(tmp_path / "data", free_port(), "--tokens-file", str(tokens))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("draftcache serve: error:")
    assert "unknown limit 'max_sesions'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data" / "redis" / "server.pid").exists()  # storage never started


def test_a_start_that_fails_after_storage_started_stops_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _serve(tmp_path / "data", taken.getsockname()[1], "--host", "127.0.0.1")
    assert done.returncode == 2, done.stderr
    assert "could not bind" in done.stderr and "Traceback" not in done.stderr
    assert _servers_on(tmp_path / "data") == []


def test_a_second_service_on_a_port_in_use_refuses_to_start(tmp_path: Path) -> None:
    """Two single-process services on one port (another data folder, their own Redis): the
    second is refused at its start and stops its storage, where both listened and the kernel
    split clients between them at random. (Worker processes of one service still share theirs:
    tests/service/test_processes.py.)"""
    with Serve(tmp_path / "first") as first:
        second = _serve(tmp_path / "second", first.port)
        assert second.returncode == 2, second.stderr
        assert "could not bind" in second.stderr and "Traceback" not in second.stderr
        assert _servers_on(tmp_path / "second") == []  # its storage stopped
        assert first.stats().storage.available

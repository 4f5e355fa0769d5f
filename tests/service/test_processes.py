"""``draftcache serve --processes 2``: two workers on one port and one Redis, supervised."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.app import AppConfig, connect
from cache_service.config import ServerConfig
from cache_service.host.embedded_redis import free_port
from cache_service.host.workers import check_ports
from cache_service.storage.redis_store import RedisStore
from indexer.prior import PriorConfig, StaticPrior
from tests.faults import READY_S, children, wait_serving


def _free_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free (the workers' metrics ports), below the kernel's
    ephemeral range: a port picked from that range may be taken by any outgoing connection (a
    worker's to Redis) before the second worker binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        p = random.randrange(max(1024, low - 10_000), low - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two free adjacent ports")


def _workers(pid: int) -> list[int]:
    """The supervisor's worker processes (not its Redis or multiprocessing's helpers)."""
    out = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(child)
    return out


def _maps(pid: int, folder: Path) -> bool:
    try:
        return str(folder) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _drafts(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("draftcache_drafts_total"))


def _both_up(metrics_port: int, proc: subprocess.Popen[bytes]) -> None:
    """Wait until both workers serve their metrics (each starts them just before it reports
    serving; the port's health answers as soon as either does)."""
    deadline = time.monotonic() + READY_S
    for port in (metrics_port, metrics_port + 1):
        while True:
            try:
                _drafts(port)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _draft_on_new_connections(target: str, n: int) -> None:
    for _ in range(n):  # a new channel is a new connection: the kernel picks a worker for it
        with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            stub = pb_grpc.DraftCacheStub(ch)
            req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[1, 2, 3, 1, 2])])
            deadline = time.monotonic() + 30
            while True:  # a worker learns of a new namespace through Redis, within a few seconds
                try:
                    sid = stub.OpenSessions(req, wait_for_ready=True, timeout=30).session_ids[0]
                    break
                except grpc.RpcError as exc:
                    if exc.code() is not grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            tree = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid)]), timeout=30).trees[0]
            assert tree.tokens[0] == 3


def _serving_toy(target: str, metrics: int, proc: subprocess.Popen[bytes]) -> None:
    """Both workers of ``proc`` up (health and their metrics), and namespace ``toy`` made."""
    with wait_serving(target, proc) as ch:
        _both_up(metrics, proc)
        pb_grpc.AdminStub(ch).CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))


def test_two_workers_share_the_port_and_a_dead_one_is_replaced(tmp_path: Path) -> None:
    port, metrics, own = free_port(), _free_pair(), _free_pair()
    while abs(own - metrics) < 2:  # two pairs, apart
        own = _free_pair()
    cmd = [sys.executable, "-m", "cache_service.cli", "serve", "--processes", "2", "--port", str(port)]
    cmd += ["--data-dir", str(tmp_path), "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1"]
    cmd += ["--worker-ports", str(own)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = f"127.0.0.1:{port}"
    try:
        _serving_toy(target, metrics, proc)
        _draft_on_new_connections(target, 16)
        # Both workers served some of the 16 connections (each reports its own drafts).
        per_worker = [_drafts(metrics), _drafts(metrics + 1)]
        assert sum(per_worker) == 16 and min(per_worker) > 0, per_worker
        # Each worker's own port reaches that worker alone, whatever the connection.
        _draft_on_new_connections(f"127.0.0.1:{own}", 3)
        _draft_on_new_connections(f"127.0.0.1:{own + 1}", 5)
        assert [_drafts(metrics), _drafts(metrics + 1)] == [per_worker[0] + 3, per_worker[1] + 5]
        # A published prior is saved once and mapped by both workers (its pages shared).
        store = RedisStore(connect((tmp_path / "redis" / "url").read_text()))
        prior = StaticPrior.build(np.array([40, 41, 42, 43] * 3, dtype=np.int32), PriorConfig(orders=(1, 2)))
        version = store.put_prior("toy", prior.to_bytes())
        folder = tmp_path / "priors" / "toy" / f"v{version}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_maps(pid, folder) for pid in _workers(proc.pid)):
            time.sleep(0.2)
        assert folder.is_dir() and all(_maps(pid, folder) for pid in _workers(proc.pid))
        # Lifetime indexes: one worker builds a generation from the log, both map it.
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.DraftCacheStub(ch)
            opened = stub.OpenSessions(
                pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[7, 8, 9])])
            )
            close = pb.CloseSession(session_id=opened.session_ids[0], commit=True)
            stub.CloseSessions(pb.CloseSessionsRequest(sessions=[close]))
            pb_grpc.AdminStub(ch).Rebuild(pb.RebuildRequest(namespace="toy"))
        current = tmp_path / "lifetime" / "toy" / "current.json"
        assert current.is_file()
        generation = current.parent / json.loads(current.read_text())["folder"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_maps(pid, generation) for pid in _workers(proc.pid)):
            time.sleep(0.2)
        assert all(_maps(pid, generation) for pid in _workers(proc.pid))
        # A worker killed outright is replaced; the port keeps serving meanwhile.
        workers = _workers(proc.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        _draft_on_new_connections(target, 4)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = _workers(proc.pid)
            if len(now) == 2 and workers[0] not in now:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the dead worker was not replaced")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    assert proc.returncode == 0


# The supervisor of two workers on ``port`` (metrics on ``metrics`` and the next), data in
# ``folder``, that takes a worker silent for 3 s for hung.
_SUPERVISE = """
import sys
from pathlib import Path
from cache_service.app import AppConfig
from cache_service.config import EmbeddedRedisConfig, ServerConfig
from cache_service.host import workers
port, metrics, folder = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
workers.HANG_S = 3.0
config = AppConfig(
    server=ServerConfig(host="127.0.0.1", port=port),
    embedded=EmbeddedRedisConfig(data_dir=folder / "redis"),
    metrics_port=metrics,
    metrics_host="127.0.0.1",
)
workers.serve_processes(config, 2)
"""


def test_a_hung_worker_is_replaced(tmp_path: Path) -> None:
    """A worker that stops serving (SIGSTOP here; a deadlock alike) kept its share of the port's
    new connections, each waiting on it until it was continued: with two workers, half the
    connections hung. The supervisor kills a worker whose loop has not beaten for HANG_S and
    starts another."""
    port, metrics = free_port(), _free_pair()
    cmd = [sys.executable, "-c", _SUPERVISE, str(port), str(metrics), str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = f"127.0.0.1:{port}"
    try:
        _serving_toy(target, metrics, proc)
        _draft_on_new_connections(target, 4)
        hung = _workers(proc.pid)[0]
        os.kill(hung, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = _workers(proc.pid)
            if len(now) == 2 and hung not in now:
                break
            time.sleep(0.2)
        else:
            os.kill(hung, signal.SIGCONT)
            raise AssertionError("the stopped worker was not replaced")
        _both_up(metrics, proc)  # the replacement serves; every new connection is answered
        _draft_on_new_connections(target, 8)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    assert proc.returncode == 0


def test_overlapping_port_ranges_are_refused(tmp_path: Path) -> None:
    config = AppConfig(server=ServerConfig(port=6000), metrics_port=7000)
    check_ports(config, 4, 8000)  # 6000; 8000-8003; 7000-7003
    for processes, worker_ports in ((4, 5997), (2, 6999), (4, 65533)):
        with pytest.raises(ValueError):
            check_ports(config, processes, worker_ports)
    with pytest.raises(ValueError, match="own_port"):
        ServerConfig(port=6000, own_port=6000)

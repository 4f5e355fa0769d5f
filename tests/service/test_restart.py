"""The real ``draftcache serve`` on its embedded, persistent Redis: killed with SIGKILL and
restarted, it comes back with its namespaces, lifetime memory and priors."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.app import connect
from cache_service.host.embedded_redis import free_port
from cache_service.storage.redis_store import RedisStore
from indexer.prior import PriorConfig, StaticPrior
from indexer.tree_builder import Tier
from tests.faults import wait_serving


def _open(stub: pb_grpc.DraftCacheStub, prompt: list[int]) -> str:
    req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=prompt)])
    return str(stub.OpenSessions(req).session_ids[0])


def _serve(data: Path, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "cache_service.cli", "serve", "--port", str(port), "--data-dir", str(data)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{port}", proc).close()  # the first start compiles
    except AssertionError as exc:
        if proc.poll() is None:
            proc.kill()
        raise AssertionError(f"{exc}: {proc.stdout.read().decode() if proc.stdout else ''}") from None
    return proc


@pytest.fixture
def data(tmp_path: Path):  # type: ignore[no-untyped-def]
    yield tmp_path
    pid_file = tmp_path / "redis" / "server.pid"  # the embedded Redis a killed service left behind
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


def test_sigkill_and_restart_keep_lifetime_and_prior(data: Path) -> None:
    port = free_port()
    proc = _serve(data, port)
    stub = pb_grpc.DraftCacheStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    admin = pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
    sid = stub.OpenSessions(
        pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[5, 6, 7, 8, 9])])
    ).session_ids[0]
    stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)]))
    # A prior published to the service's storage (as 'draftcache warm' does) is picked up.
    store = RedisStore(connect((data / "redis" / "url").read_text()))
    prior = StaticPrior.build(np.array([40, 41, 42, 43] * 3, dtype=np.int32), PriorConfig(orders=(1, 2)))
    version = store.put_prior("toy", prior.to_bytes())
    (info,) = admin.Rebuild(pb.RebuildRequest(namespace="toy")).namespaces
    assert info.prior_version == version and info.buffered_tokens == 6  # 5 tokens + separator
    proc.send_signal(signal.SIGKILL)  # no shutdown of any kind
    proc.wait(10)

    proc = _serve(data, port)  # a new process on the same data folder
    try:
        (info,) = admin.Stats(pb.StatsRequest(namespace="toy")).namespaces
        # Everything acknowledged before the kill is back.
        assert (info.vocab_size, info.buffered_tokens, info.requests, info.prior_version) == (100, 6, 1, version)
        sid = stub.OpenSessions(
            pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[1, 5, 6])])
        ).session_ids[0]
        tree = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid)])).trees[0]
        # "5 6" is only known from the request committed before the kill: 7 8 9 follows.
        assert list(tree.tokens[:3]) == [7, 8, 9]
        assert tree.sources[0] in (Tier.LIFETIME_SA, Tier.LIFETIME_NGRAM)
        prior_tree = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[41])])).trees[0]
        assert prior_tree.tokens[0] == 42  # the restored prior knows what follows 41
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: drains, flushes, stops its Redis
        assert proc.wait(30) == 0


def test_sessions_command_lists_stored_sessions(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cache_service.cli import main

    port = free_port()
    proc = _serve(data, port)
    try:
        stub = pb_grpc.DraftCacheStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{port}")).CreateNamespace(
            pb.CreateNamespaceRequest(name="toy", vocab_size=100)
        )
        sid = _open(stub, [1, 2, 3])
        deadline = time.monotonic() + 10
        while True:  # written behind within the flush interval
            assert main(["sessions", "--data-dir", str(data)]) == 0
            out = capsys.readouterr().out
            if sid in out or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert f"{sid}  toy  3 tokens (3 prompt)" in out
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_decoding_rides_through_a_killed_service(data: Path) -> None:
    from decoder_client.client import ClientConfig, DraftClient

    port = free_port()
    proc = _serve(data, port)
    target = f"127.0.0.1:{port}"
    pb_grpc.AdminStub(grpc.insecure_channel(target)).CreateNamespace(
        pb.CreateNamespaceRequest(name="toy", vocab_size=100)
    )
    text = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    prompt = [*text, 1]
    output = [t for k in range(2, 12) for t in (*text, k)]  # ten copies, each ended by a new token
    client = DraftClient(ClientConfig(target=target, namespace="toy", deadline_s=0.05, retry_after_s=0.2))
    (session,) = client.open([prompt])
    produced: list[int] = []
    new: list[int] = []
    step = 0
    while len(produced) < len(output):
        if step == 3:  # mid-generation: the service dies without any shutdown
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        if step == 5:  # and comes back on the same data folder
            proc = _serve(data, port)
        (tree,) = client.draft([session], [new])
        path = [int(tree.tokens[i]) for i in tree.accept(np.array(output[len(produced) :], dtype=np.int32))]
        new = output[len(produced) : len(produced) + len(path) + 1]
        produced += new
        step += 1
        time.sleep(0.05)  # the target's verification
    try:
        # Generation completed exactly; local drafts covered the outage; the service was used
        # again once it was back (the session re-opened with its full context).
        assert produced == output and client.stats.fallback > 0
        # The session is re-opened in the background; within a few steps the service drafts again.
        remote_before, deadline = client.stats.remote, time.monotonic() + 20
        while client.stats.remote == remote_before and time.monotonic() < deadline:
            client.draft([session], [[]])
            time.sleep(0.05)
        assert client.stats.remote > remote_before and client.stats.reopened >= 1
        client.shutdown()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0

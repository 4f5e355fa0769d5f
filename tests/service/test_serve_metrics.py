"""``draftcache serve`` with metrics and JSON logs: the real process, scraped over HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.host.embedded_redis import free_port
from tests.faults import wait_serving


def test_serve_exports_metrics_and_logs_json(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "cache_service.cli", "--log-format", "json", "serve", "--port", str(port)]
    cmd += ["--data-dir", str(tmp_path), "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        target = f"127.0.0.1:{port}"
        with wait_serving(target, proc) as ch:  # a first start compiles the kernels
            pb_grpc.AdminStub(ch).CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=50))
            stub = pb_grpc.DraftCacheStub(ch)
            req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[1, 2, 3, 1, 2])])
            sid = stub.OpenSessions(req).session_ids[0]
            stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid)]))
            # A finished request, and a rebuild on request: measured as the scheduler's are.
            req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[4, 5, 6])])
            done = stub.OpenSessions(req).session_ids[0]
            close = pb.CloseSession(session_id=done, commit=True, new_tokens=[7, 8, 9])
            stub.CloseSessions(pb.CloseSessionsRequest(sessions=[close]))
            pb_grpc.AdminStub(ch).Rebuild(pb.RebuildRequest(namespace="toy"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'draftcache_rebuild_seconds_count{namespace="toy",suffix="sorted",table="new"} 1.0' in text
        assert 'draftcache_rpc_seconds_count{code="OK",method="Draft"} 1.0' in text
        assert 'draftcache_sessions{namespace="toy"} 1.0' in text
        assert "draftcache_writeback_lag_seconds 0.0" in text
        assert "draftcache_session_save_age_seconds" in text
        assert "draftcache_compiles_while_serving_total 0.0" in text  # start-up compiled it all
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    # Every log line is one JSON object.
    lines = [line for line in err.decode().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    assert any("listening" in r["message"] for r in records)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert proc.returncode == 0

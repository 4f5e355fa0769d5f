"""What a long storage outage may grow stays bounded: sessions closed while Redis is down are
remembered for deletion only up to the session limit (their stored copies expire anyway)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.config import ServiceConfig
from tests.service.test_redis_outage import app_on_redis


def test_sessions_closed_during_an_outage_are_remembered_up_to_the_session_limit(tmp_path: Path) -> None:
    service = ServiceConfig(max_sessions=40, flush_interval_s=0.05, follow_interval_s=0.05)
    with (
        app_on_redis(tmp_path, service) as (app, redis, port, _),
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        stub, admin = pb_grpc.DraftCacheStub(channel), pb_grpc.AdminStub(channel)
        admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns", vocab_size=100))
        redis.kill()
        for _ in range(10):  # 300 sessions opened and closed while storage is down
            ids = stub.OpenSessions(
                pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns", prompt=[1, 2, 3])] * 30)
            ).session_ids
            stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=s) for s in ids]))
            time.sleep(0.06)  # a write-back round fails and puts the closed ids back
        time.sleep(0.3)  # more rounds fail
        assert len(app.service.changes._closed) <= 40

"""The Prometheus endpoint of a real server, scraped over HTTP after real calls."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from cache_service.config import ServerConfig, ServiceConfig
from cache_service.domain.service import DraftService
from cache_service.metrics import Metrics
from cache_service.rpc.server import create_server
from tests.service.test_redis_outage import app_on_redis


class _Queue:
    """Write-back state to report (what storage would say)."""

    pending = 3

    def oldest_pending_age_s(self) -> float:
        return 1.5


@pytest.fixture
def served() -> Iterator[tuple[pb_grpc.DraftCacheStub, int, DraftService]]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    service = DraftService(ServiceConfig())
    metrics = Metrics()
    metrics.watch(service, _Queue(), session_saves=lambda: 0.0)
    server = asyncio.run_coroutine_threadsafe(
        create_server(ServerConfig(port=0), service, metrics.observe_rpc), loop
    ).result(30)
    asyncio.run_coroutine_threadsafe(server.set_serving(True), loop).result(5)
    http_port = metrics.serve(0, "127.0.0.1")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.DraftCacheStub(channel), http_port, service
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_calls_tiers_and_state_are_reported(served) -> None:  # type: ignore[no-untyped-def]
    stub, port, service = served
    service.create_namespace("ns", 64)
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    (sid,) = stub.OpenSessions(
        pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns", prompt=text + text[:2])])
    ).session_ids
    tree = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid)])).trees[0]
    assert list(tree.tokens[:3]) == [7, 8, 9]  # the context tier continues the copy
    stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[7, 8, 9, 60])]))
    with pytest.raises(grpc.RpcError):
        stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id="nope")]))
    m = _scrape(port)
    # Two good draft calls and one NOT_FOUND, timed by method and status.
    assert m[("draftcache_rpc_seconds_count", (("code", "OK"), ("method", "Draft")))] == 2
    assert m[("draftcache_rpc_seconds_count", (("code", "NOT_FOUND"), ("method", "Draft")))] == 1
    # The outcome after the first tree: three of its tokens accepted, from the context tier.
    assert m[("draftcache_steps_total", (("namespace", "ns"),))] == 1
    assert m[("draftcache_accepted_tokens_total", (("namespace", "ns"), ("tier", "CONTEXT")))] == 3
    assert m[("draftcache_sessions", (("namespace", "ns"),))] == 1
    assert m[("draftcache_drafts_total", ())] == 2
    assert m[("draftcache_drafts_ahead_skipped_total", ())] == 0  # none asked for outcomes ahead
    # Storage's write-back queue as the service reports it.
    assert m[("draftcache_writeback_pending", ())] == 3
    assert m[("draftcache_writeback_lag_seconds", ())] == 1.5
    assert m[("draftcache_buffer_fill_ratio", (("namespace", "ns"),))] == 0.0


def test_rebuilds_and_stream_messages_are_timed(served) -> None:  # type: ignore[no-untyped-def]
    stub, port, service = served
    service.create_namespace("ns", 64)
    drafter = service.namespace("ns")
    drafter.memory.commit(np.arange(40, dtype=np.int32))
    metrics = Metrics()
    metrics.observe_rebuild("ns", drafter.memory.rebuild())  # the first: sorted, its table new
    drafter.memory.commit(np.arange(3, dtype=np.int32))
    metrics.observe_rebuild("ns", drafter.memory.rebuild())  # 4 new of 45 tokens: extended, table kept

    def count(suffix: str, table: str) -> float | None:
        labels = {"namespace": "ns", "suffix": suffix, "table": table}
        return metrics.registry.get_sample_value("draftcache_rebuild_seconds_count", labels)

    assert (count("sorted", "new"), count("extended", "carried"), count("extended", "new")) == (1.0, 1.0, None)
    requests = iter(
        [
            pb.StreamRequest(
                request_id=1, open=pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns", prompt=[1, 2, 3])])
            )
        ]
    )
    (resp,) = list(stub.Stream(requests))
    assert resp.open.session_ids
    m = _scrape(port)
    assert m[("draftcache_rpc_seconds_count", (("code", "OK"), ("method", "Stream.open")))] == 1
    assert m[("draftcache_buffer_tokens", (("namespace", "ns"),))] == 45  # 40 tokens, 3, each with a separator


def test_a_deleted_namespace_takes_its_series_along() -> None:
    """Namespaces created and deleted over weeks leave no series behind (each would stay in the
    process and in every scrape for good)."""
    service = DraftService(ServiceConfig())
    metrics = Metrics()
    metrics.watch(service)
    port = metrics.serve(0, "127.0.0.1")
    for name in ("kept", "gone-1", "gone-2"):
        service.create_namespace(name, 64)
        service.namespace(name).memory.commit(np.arange(40, dtype=np.int32))
        metrics.observe_rebuild(name, service.namespace(name).memory.rebuild())
    service.delete_namespace("gone-1")

    def namespaces_in(scrape: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
        return {dict(labels)["namespace"] for name, labels in scrape if name.startswith("draftcache_rebuild_seconds")}

    assert namespaces_in(_scrape(port)) == {"kept", "gone-2"}  # gone from the first scrape after
    service.delete_namespace("gone-2")
    metrics.observe_rebuild("kept", service.namespace("kept").memory.rebuild())  # no scrape needed
    assert {labels[0] for labels in metrics.rebuild_seconds._metrics} == {"kept"}
    assert namespaces_in(_scrape(port)) == {"kept"}


def test_a_service_without_a_metrics_port_drops_what_it_kept_of_a_deleted_namespace(tmp_path: Path) -> None:
    """Rebuild series are kept in the process though nothing scrapes them, and each namespace's
    last rebuild time: both go with the namespace."""
    with app_on_redis(tmp_path) as (app, *_):
        for name in ("kept", "gone"):
            app.service.create_namespace(name, 64)
            app.service.namespace(name).memory.commit(np.arange(40, dtype=np.int32))
            app._rebuild_one(name, "")
        assert {labels[0] for labels in app.metrics.rebuild_seconds._metrics} == {"kept", "gone"}
        app.service.delete_namespace("gone")
        app._rebuild_large_deltas()
        assert set(app._last_rebuild) == {"kept"}
        app.service.namespace("kept").memory.commit(np.arange(30, dtype=np.int32))
        app._rebuild_one("kept", "")
        assert {labels[0] for labels in app.metrics.rebuild_seconds._metrics} == {"kept"}

"""Calls while Redis is down or hung. The client names its sessions, and the service cannot
then check the ids against stored sessions: it opens them all the same, so drafting from the
service and commits (journaled) go on through an outage, and storage keeps another tenant's
stored session from being written over or deleted by a session opened so. Namespace calls,
which must reach storage, answer within the call timeout."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.app import App
from cache_service.config import ServiceConfig
from cache_service.domain.items import CloseItem, OpenItem
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from cache_service.storage.stored_session import StoredSession
from decoder_client.client import ClientConfig, DraftClient
from indexer.drafter import DraftParams
from indexer.session import SessionSnapshot
from tests.service.test_redis_outage import Redis, app_on_redis, logged_requests

Served = tuple[App, Redis, int, Callable[[Callable[[], object]], object]]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    service = ServiceConfig(flush_interval_s=0.05, follow_interval_s=0.05)
    with app_on_redis(tmp_path, service, call_timeout_s=0.5) as (app, redis, port, loop):
        app.service.create_namespace("ns", 1000)

        async def call(fn: Callable[[], object]) -> object:
            return fn()

        def on_loop(fn: Callable[[], object]) -> object:  # where the service's calls run
            return asyncio.run_coroutine_threadsafe(call(fn), loop).result(30)

        yield app, redis, port, on_loop


def test_requests_decoded_while_redis_is_down_draft_from_the_service_and_are_committed(
    served: Served,
) -> None:
    app, redis, port, _ = served
    # A draft call's deadline of its own: what is asserted is that the service drafts through
    # the outage, not how fast (a call past the default 5 ms, on a loaded host, is answered by
    # the client's fallback).
    config = ClientConfig(target=f"127.0.0.1:{port}", namespace="ns", control_timeout_s=5.0, deadline_s=2.0)
    client = DraftClient(config)
    rng = np.random.default_rng(0)
    requests = [[*rng.integers(0, 900, 12).tolist(), 900 + i] for i in range(12)]
    try:
        redis.kill()
        sessions = client.open([r[:6] for r in requests])  # the client chooses every id
        for step in range(6, 12, 2):
            client.draft(sessions, [r[step : step + 2] for r in requests])
        client.add_tokens(sessions, [r[12:] for r in requests])
        client.close(sessions, commit=True)
        client.shutdown()
        assert client.stats.remote == 3 * len(requests) and client.stats.fallback == 0
        assert client.stats.commits_dropped == client.stats.commits_retried == 0
        assert app.persistence.pending == len(requests)  # acknowledged into the journal
        redis.start()
        deadline = time.monotonic() + 30
        while app.persistence.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(logged_requests(redis.url, "ns")) == sorted(requests)  # each once
    finally:
        client.shutdown()


def test_a_session_opened_unchecked_under_another_tenants_id_leaves_that_session_as_stored(
    served: Served,
) -> None:
    app, redis, _, on_loop = served
    store = RedisStore(connect(redis.url))
    snap = SessionSnapshot(context=np.array([7, 8, 9], np.int32), prompt_len=2)
    theirs = StoredSession("ns", snap, DraftParams(budget=8), tenant="acme")
    store.save_session("taken-one-0000001", theirs, ttl_s=600)
    store.save_session("taken-two-0000002", theirs, ttl_s=600)
    service = app.service
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)  # storage answers nothing
    try:
        items = [
            OpenItem("ns", [1, 2, 3], session_id=sid)
            for sid in ("taken-one-0000001", "taken-two-0000002", "mine-000000000001")
        ]
        opened = on_loop(lambda: service.finish_open(service.prepare_open(items, unchecked=True)))
        assert opened == ["taken-one-0000001", "taken-two-0000002", "mine-000000000001"]
        on_loop(lambda: service.close([CloseItem("taken-two-0000002", commit=False)]))  # before any write-back
    finally:
        redis.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while service.sessions.holds("taken-one-0000001") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not service.sessions.holds("taken-one-0000001")  # the write-back found the id taken: ended here
    mine = service.sessions.find("mine-000000000001")
    assert mine is not None and not mine.unchecked  # written back: storage holds it now
    for sid in ("taken-one-0000001", "taken-two-0000002"):
        kept = store.load_session(sid)
        assert kept is not None and kept.tenant == "acme" and kept.context.tolist() == [7, 8, 9]
    assert store.load_session("mine-000000000001") is not None


def test_namespace_calls_answer_within_the_call_timeout_while_redis_is_frozen(served: Served) -> None:
    """CreateNamespace and DeleteNamespace wait on storage: a hung Redis holds them for the
    call timeout (0.5 s here), not the background client's 30 s socket timeout and retry."""
    app, redis, port, _ = served
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    admin = pb_grpc.AdminStub(channel)
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        for call, request in (
            (admin.CreateNamespace, pb.CreateNamespaceRequest(name="other", vocab_size=100)),
            (admin.DeleteNamespace, pb.DeleteNamespaceRequest(name="ns")),
        ):
            began = time.monotonic()
            # A call that overstays leaves every thread's stack in the report (seen once: a
            # CreateNamespace unanswered for 20 s, never reproduced).
            faulthandler.dump_traceback_later(5)
            try:
                with pytest.raises(grpc.RpcError) as err:
                    call(request, timeout=20)
            finally:
                faulthandler.cancel_dump_traceback_later()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - began < 5
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        channel.close()
    assert "ns" in app.service.namespace_names()  # not dropped here (storage may yet apply what it was sent)
    admin_again = pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    admin_again.DeleteNamespace(pb.DeleteNamespaceRequest(name="ns"), timeout=20)  # a retry finishes it
    assert "ns" not in app.service.namespace_names() and "ns" not in RedisStore(connect(redis.url)).namespaces()

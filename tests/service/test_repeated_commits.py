"""A request's commit reaches the lifetime log once, even when its client sends it again: a
close with commit the service applied, whose answer the client never got, is retried under a
new session with the key the first one named, and the log, and each replica's lifetime memory,
take it once. On a real Redis and real gRPC services."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.app import App
from cache_service.config import EmbeddedRedisConfig, ServiceConfig
from cache_service.host.embedded_redis import EmbeddedRedis
from decoder_client.client import AsyncDraftClient, ClientConfig, DraftClient
from tests.service.conftest import Replica, Running, eventually
from tests.service.test_redis_outage import app_on_redis, logged_requests

REQUEST = [5, 17, 23, 42, 8, 15, 16, 4, 99, 7]
KEY = "9f86d081884c7d659a2feaa0c55ad015"


def _until(done: Callable[[], bool], step: Callable[[], object], timeout_s: float = 20.0) -> None:
    """``step()`` until ``done()``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not reached in time"
        step()
        time.sleep(0.05)


@pytest.mark.parametrize("transport", ["unary", "stream", "aio"])
def test_a_close_whose_answer_was_lost_is_logged_once_when_the_client_retries(tmp_path: Path, transport: str) -> None:
    """Redis freezes while a close commits: the service waits its storage call timeout (1 s),
    journals the commit and answers OK, but the client gave up at 0.3 s and keeps the request
    to commit again. Redis returns, the journal's replay lands the commit, and the client's
    retry (a new session, closed with commit under the same key) is acknowledged and skipped:
    one log entry (two without the key), one request in the replica's lifetime memory."""
    service = ServiceConfig(flush_interval_s=0.05, follow_interval_s=0.05)
    with app_on_redis(tmp_path, service, call_timeout_s=1.0) as (app, redis, port, _):
        app.service.create_namespace("ns", 128)
        config = ClientConfig(
            target=f"127.0.0.1:{port}",
            namespace="ns",
            control_timeout_s=0.3,
            retry_after_s=0.05,
            stream=transport != "unary",
        )
        assert redis.proc is not None
        if transport == "aio":
            asyncio.run(_aio_retry(config, app, redis.proc))
        else:
            _sync_retry(config, app, redis.proc)
        assert logged_requests(redis.url, "ns") == [REQUEST]
        assert app.storage_health().repeated_commits == 1
        assert app.service.namespace("ns").memory.requests == 1


def _sync_retry(config: ClientConfig, app: App, proc: subprocess.Popen[bytes]) -> None:
    client = DraftClient(config)
    try:
        (session,) = client.open([REQUEST[:6]])
        client.add_tokens([session], [REQUEST[6:]])
        proc.send_signal(signal.SIGSTOP)
        try:
            client.close([session])  # fails at the client's deadline, and the service journals it
            _until(lambda: bool(client.stats.commits_retried and app.persistence.pending), client.settle)
        finally:
            proc.send_signal(signal.SIGCONT)
        _until(lambda: client.stats.commits_pending == 0, client.settle)  # the retry landed
        assert client.stats.commits_dropped == 0
    finally:
        client.shutdown()


async def _aio_retry(config: ClientConfig, app: App, proc: subprocess.Popen[bytes]) -> None:
    client = AsyncDraftClient(config)
    try:
        (session,) = await client.open([REQUEST[:6]])
        client.add_tokens([session], [REQUEST[6:]])
        proc.send_signal(signal.SIGSTOP)
        try:
            await client.close([session])
            for _ in range(200):  # the close fails at the client's deadline ...
                await client.settle()
                if client.stats.commits_retried and app.persistence.pending:
                    break  # ... and the service journaled it (its answer lost)
                await asyncio.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGCONT)
        for _ in range(400):
            await client.settle()
            if client.stats.commits_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert client.stats.commits_retried == 1 and client.stats.commits_pending == 0
    finally:
        await client.shutdown()


@pytest.fixture
def two_replicas(tmp_path: Path) -> Iterator[tuple[Replica, Replica, str]]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    try:
        first = Replica(server.url)
        try:
            second = Replica(server.url)
            try:
                first.admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns", vocab_size=128))
                eventually(lambda: "ns" in second.app.service.namespace_names())
                yield first, second, server.url
            finally:
                second.stop()
        finally:
            first.stop()
    finally:
        server.stop()


def _open_and_commit(replica: Replica, sid: str, key: str) -> None:
    opened = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns", prompt=REQUEST[:6], session_id=sid)])
    replica.stub.OpenSessions(opened, timeout=10)
    close = pb.CloseSession(session_id=sid, commit=True, new_tokens=REQUEST[6:], commit_key=key)
    replica.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[close]), timeout=10)


def test_a_retry_through_another_replica_is_logged_and_remembered_once(
    two_replicas: tuple[Replica, Replica, str],
) -> None:
    """The first close landed through one replica, the retry goes to another: the log keeps one
    entry, and the second replica's memory holds the request once (read from the log), not
    again at its close. Another key, or none, is another commit."""
    first, second, url = two_replicas
    _open_and_commit(first, "first-try-0000000001", KEY)
    memory = second.app.service.namespace("ns").memory
    eventually(lambda: memory.requests == 1)  # followed from the log
    _open_and_commit(second, "retry-000000000000001", KEY)
    time.sleep(0.3)  # several rounds of following
    assert logged_requests(url, "ns") == [REQUEST]
    assert memory.requests == 1 and second.app.storage_health().repeated_commits == 1
    _open_and_commit(second, "another-0000000000001", "another-request-0000001")
    _open_and_commit(second, "no-key-00000000000001", "")
    eventually(lambda: first.app.service.namespace("ns").memory.requests == 3)
    assert logged_requests(url, "ns") == [REQUEST] * 3 and memory.requests == 3


def test_a_retry_a_replica_can_only_journal_is_not_remembered_again_once_it_followed_the_first(
    two_replicas: tuple[Replica, Replica, str], tmp_path: Path
) -> None:
    """The first close landed through one replica and the second took it from the log; the
    client's retry then reaches the second while storage does not answer, so the second can
    only journal it (no log to say it holds it). Its memory holds the request once all the
    same (it knows the key from the log), and the journal's replay, storage back, appends
    nothing. Before followed keys were recorded, the memory took the request a second time."""
    first, second, url = two_replicas
    _open_and_commit(first, "first-try-0000000001", KEY)
    memory = second.app.service.namespace("ns").memory
    eventually(lambda: memory.requests == 1)  # followed from the log
    pid = int((tmp_path / "server.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        _open_and_commit(second, "retry-000000000000001", KEY)  # acknowledged: journaled
        assert second.app.persistence.pending == 1 and memory.requests == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    eventually(lambda: second.app.persistence.pending == 0)  # replayed
    assert logged_requests(url, "ns") == [REQUEST] and second.app.storage_health().repeated_commits == 1
    time.sleep(0.3)  # several rounds of following
    assert memory.requests == 1 and first.app.service.namespace("ns").memory.requests == 1


def test_without_storage_a_replica_takes_a_retried_commit_once(running: Running) -> None:
    """No Redis to ask: the replica remembers the keys its memory took."""
    for sid in ("first-try-0000000001", "retry-000000000000001"):
        opened = pb.OpenSession(namespace="ns", prompt=REQUEST[:6], session_id=sid)
        if sid.startswith("first"):
            running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns", vocab_size=128))
        running.stub.OpenSessions(pb.OpenSessionsRequest(sessions=[opened]), timeout=10)
        close = pb.CloseSession(session_id=sid, commit=True, new_tokens=REQUEST[6:], commit_key=KEY)
        running.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[close]), timeout=10)
    eventually(lambda: running.service.namespace("ns").memory.requests >= 1)
    time.sleep(0.2)  # commits run off the request loop
    assert running.service.namespace("ns").memory.requests == 1


@pytest.mark.parametrize("key", ["short-key", "k" * 65, "spaces are not taken here", "ключ-ключ-ключ-ключ"])
def test_a_bad_commit_key_is_refused_and_nothing_closes(running: Running, key: str) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns", vocab_size=128))
    opened = pb.OpenSession(namespace="ns", prompt=REQUEST[:6], session_id="kept-open-0000000001")
    running.stub.OpenSessions(pb.OpenSessionsRequest(sessions=[opened]), timeout=10)
    close = pb.CloseSession(session_id="kept-open-0000000001", commit=True, commit_key=key)
    with pytest.raises(grpc.RpcError) as err:
        running.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[close]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "commit key" in (err.value.details() or "")
    assert running.service.sessions.holds("kept-open-0000000001")

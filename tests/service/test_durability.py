"""No acknowledged commit is lost, whatever dies: ``draftcache serve`` in a subprocess, its
embedded Redis (or an external one) killed, the service killed or stopped, the data disk
filled; after recovery every acknowledged commit is in the lifetime log exactly once."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.host.embedded_redis import free_port
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from tests.faults import Serve, can_mount_tmpfs, fill_disk, kill, log_entries, small_disk, state, wait_for
from tests.service.test_redis_outage import Redis

STOP_S = 15.0  # SIGTERM to exit, storage up or down


def _tokens(i: int) -> list[int]:
    rng = np.random.default_rng(i)
    return [*rng.integers(0, 900, 12).tolist(), 900 + i % 90]  # distinct per request


def _commit(serve: Serve, i: int) -> bool:
    """Request ``i`` opened and closed with a commit; whether the commit was acknowledged (a
    refusal must say UNAVAILABLE: never an OK for a commit that is not durable)."""
    tokens = _tokens(i)
    try:
        opened = serve.stub.OpenSessions(
            pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns", prompt=tokens[:6])]), timeout=10
        )
        close = pb.CloseSession(session_id=opened.session_ids[0], commit=True, new_tokens=tokens[6:])
        serve.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[close]), timeout=10)
        return True
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
        return False


def _commits(serve: Serve, ids: range) -> list[int]:
    return [i for i in ids if _commit(serve, i)]


def _assert_logged_once(url: str, acked: list[int], attempted: range) -> None:
    """Every acknowledged commit in the log once, with its tokens; nothing else but attempts."""
    logged = [tuple(t) for t in log_entries(url, "ns")]
    assert len(logged) == len(set(logged)), "a commit is in the log twice"
    want = {tuple(_tokens(i)) for i in acked}
    assert want <= set(logged), f"{len(want - set(logged))} acknowledged commits lost"
    assert set(logged) <= {tuple(_tokens(i)) for i in attempted}


def _start(data: Path, *args: str, redis_url: str | None = None) -> Serve:
    serve = Serve(data, "--journal-capacity-mb", "4", *args, redis_url=redis_url).start()
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns", vocab_size=1000))
    return serve


def test_embedded_redis_killed_then_sigterm_keeps_every_commit(tmp_path: Path) -> None:
    serve = _start(tmp_path / "data")
    try:
        acked = _commits(serve, range(20))
        kill(serve.redis_pid())
        acked += _commits(serve, range(20, 60))  # from memory and the journal meanwhile
        began = time.monotonic()
        assert serve.sigterm(STOP_S) == 0
        assert time.monotonic() - began < STOP_S
        assert len(acked) == 60  # the journal took what Redis could not
        journaled = r"[1-9]\d* (journaled commits to replay|commits journaled|commits stay in the journal)"
        assert re.search(journaled, serve.log())  # (said by whichever noticed first)
    finally:
        serve.close()
    serve = Serve(tmp_path / "data").start()
    try:
        _assert_logged_once(serve.redis_url(), acked, range(60))
        assert len(log_entries(serve.redis_url(), "ns")) == 60
        assert serve.stats().storage.journaled_commits == 0
    finally:
        serve.close()


def test_service_killed_while_storage_is_down_keeps_every_commit(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    redis.start()
    serve = _start(tmp_path / "data", redis_url=redis.url)
    try:
        acked = _commits(serve, range(10))
        # A commit that found another write under way was journaled, not waited for: the first
        # ten are all in Redis before it dies.
        wait_for(lambda: serve.stats().storage.journaled_commits == 0, 30, "the first commits written")
        redis.kill()
        acked += _commits(serve, range(10, 40))  # Redis stays down: all of these are journaled
        health = serve.stats().storage
        assert not health.available and health.journaled_commits == 30 and health.journal_bytes > 0
        serve.sigkill()  # right after the acknowledgements
    finally:
        serve.close()
    assert (tmp_path / "data" / "journal" / "commits.journal").stat().st_size > 0
    redis.start()
    serve = Serve(tmp_path / "data", redis_url=redis.url).start()
    try:
        assert len(acked) == 40
        _assert_logged_once(redis.url, acked, range(40))
        assert len(log_entries(redis.url, "ns")) == 40
        assert serve.stats().storage.journaled_commits == 0
        assert (tmp_path / "data" / "journal" / "commits.journal").stat().st_size == 0  # drained
        assert serve.sigterm(STOP_S) == 0
    finally:
        serve.close()
        redis.kill()


def _journaled_then_killed(data: Path, redis: Redis, written: range, journaled: range) -> list[int]:
    """``written`` committed into Redis, then Redis killed, ``journaled`` committed (into the
    journal) and the service killed right after; the acknowledged commits."""
    serve = _start(data, redis_url=redis.url)
    try:
        acked = _commits(serve, written)
        wait_for(lambda: serve.stats().storage.journaled_commits == 0, 30, "the first commits written")
        redis.kill()
        acked += _commits(serve, journaled)
        serve.sigkill()
    finally:
        serve.close()
    return acked


def test_a_journal_is_replayed_when_the_service_comes_back_with_other_processes(tmp_path: Path) -> None:
    """Commits journaled by one process are replayed by a run of ``--processes 2`` (each worker
    journals in a folder of its own, and takes over what no live process holds)."""
    redis = Redis(tmp_path)
    redis.start()
    acked = _journaled_then_killed(tmp_path / "data", redis, range(5), range(5, 25))
    journal = tmp_path / "data" / "journal" / "commits.journal"
    assert journal.stat().st_size > 0
    redis.start()
    serve = Serve(tmp_path / "data", "--processes", "2", redis_url=redis.url).start()
    try:
        wait_for(lambda: len(log_entries(redis.url, "ns")) >= 25, 60, "the journal replayed")
        _assert_logged_once(redis.url, acked, range(25))
        assert len(acked) == 25 == len(log_entries(redis.url, "ns"))
        assert journal.stat().st_size == 0
        assert serve.sigterm(STOP_S + 30) == 0
    finally:
        serve.close()
        redis.kill()


def test_a_frozen_redis_holds_a_close_for_the_call_timeout_only(tmp_path: Path) -> None:
    """A Redis that stops answering (SIGSTOP: connections are still accepted) holds a close's
    commit for the storage call timeout, then the commit is journaled and acknowledged; storage
    reads that a hung Redis holds (decoders polling the log) do not hold closes up. After it
    thaws, every acknowledged commit is in the log once (one that landed late is not appended
    again by the replay)."""
    redis = Redis(tmp_path)
    redis.start()
    assert redis.proc is not None
    frozen = redis.proc.pid
    serve = _start(tmp_path / "data", redis_url=redis.url)

    def poll(_: int) -> None:
        read = pb.ReadLogRequest(namespace="ns", after="0-0", max_tokens=100)
        with contextlib.suppress(grpc.RpcError):
            serve.stub.ReadLog(read, timeout=1)

    try:
        try:
            acked = _commits(serve, range(3))
            kill(frozen, signal.SIGSTOP)
            began = time.monotonic()
            acked += _commits(serve, range(3, 4))
            assert time.monotonic() - began < 8  # the call timeout (2 s), not the background jobs' 30 s x 2
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(poll, range(16)))  # every read thread held by the frozen Redis now
                began = time.monotonic()
                acked += _commits(serve, range(4, 6))
                assert time.monotonic() - began < 8
            assert len(acked) == 6 and serve.stats().storage.journaled_commits >= 3
        finally:
            kill(frozen, signal.SIGCONT)
        wait_for(lambda: serve.stats().storage.journaled_commits == 0, 60, "the journal replayed")
        _assert_logged_once(redis.url, acked, range(6))
        assert len(log_entries(redis.url, "ns")) == 6
    finally:
        serve.close()
        redis.kill()


def test_a_journal_is_not_replayed_into_a_namespace_created_again(tmp_path: Path) -> None:
    """Commits journaled for a namespace that is deleted and created again (even with the same
    vocabulary: their log's identity tells them apart) while their service is down are dropped
    at the replay, as the deleted namespace's are: the new namespace's log never holds them."""
    redis = Redis(tmp_path)
    redis.start()
    assert len(_journaled_then_killed(tmp_path / "data", redis, range(3), range(3, 13))) == 13
    redis.start()
    store = RedisStore(connect(redis.url))
    store.delete_namespace("ns")
    store.register_namespace("ns", 1000)
    serve = Serve(tmp_path / "data", redis_url=redis.url).start()
    try:
        wait_for(lambda: serve.stats().storage.journaled_commits == 0, 30, "the journal read")
        assert log_entries(redis.url, "ns") == []
        assert "10 commits dropped" in serve.log()
        assert _commit(serve, 13)  # the new namespace's own commits go on
        assert log_entries(redis.url, "ns") == [_tokens(13)]
    finally:
        serve.close()
        redis.kill()


def test_sigterm_while_storage_stays_down_exits_promptly_and_keeps_every_commit(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    redis.start()
    serve = _start(tmp_path / "data", redis_url=redis.url)
    try:
        acked = _commits(serve, range(10))
        redis.kill()
        acked += _commits(serve, range(10, 30))
        time.sleep(1.0)  # write-back and sync jobs run (and fail) meanwhile
        began = time.monotonic()
        assert serve.sigterm(STOP_S) == 0  # no hang on the jobs, no exit 2 on "redis unavailable"
        assert time.monotonic() - began < STOP_S
        assert "20 commits stay in the journal" in serve.log()
    finally:
        serve.close()
    redis.start()
    serve = Serve(tmp_path / "data", redis_url=redis.url).start()
    try:
        assert len(acked) == 30
        _assert_logged_once(redis.url, acked, range(30))
        assert len(log_entries(redis.url, "ns")) == 30
    finally:
        serve.close()
        redis.kill()


def test_a_dead_embedded_redis_is_restarted_and_the_journal_drains(tmp_path: Path) -> None:
    metrics = free_port()
    serve = _start(tmp_path / "data", "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1")
    try:
        acked = _commits(serve, range(5))
        dead = serve.redis_pid()
        kill(dead)
        acked += _commits(serve, range(5, 25))
        wait_for(lambda: serve.stats().storage.embedded_restarts == 1, 15, "the embedded Redis to be restarted")
        wait_for(lambda: serve.stats().storage.journaled_commits == 0, 15, "the journal to drain")
        health = serve.stats().storage
        assert health.available and health.journal_bytes == 0 and not health.disk_full
        assert state(dead) == ""  # reaped, not left <defunct>
        assert serve.redis_pid() != dead
        _assert_logged_once(serve.redis_url(), acked, range(25))
        assert len(acked) == 25 and len(log_entries(serve.redis_url(), "ns")) == 25
        # What an operator sees: the stats line, the metrics, the log.
        cli = [sys.executable, "-m", "cache_service.cli", "stats", "--target", f"127.0.0.1:{serve.port}"]
        out = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        assert "storage available; journal 0 commits, 0 of 4194304 bytes; embedded Redis restarts 1" in out
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert "draftcache_embedded_redis_restarts_total 1.0" in text
        assert "draftcache_storage_up 1.0" in text and "draftcache_journal_commits 0.0" in text
        assert "embedded Redis restarted" in serve.log()
        assert serve.sigterm(STOP_S) == 0
    finally:
        serve.close()


def test_a_hung_embedded_redis_is_killed_and_restarted(tmp_path: Path) -> None:
    serve = _start(tmp_path / "data")
    try:
        acked = _commits(serve, range(5))
        hung = serve.redis_pid()
        kill(hung, signal.SIGSTOP)  # alive but answering nothing
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(_commits, serve, range(5, 6))  # its write waits on the hung Redis
            time.sleep(0.3)
            began = time.monotonic()
            acked += _commits(serve, range(6, 26))  # the others do not wait behind it: journaled
            assert time.monotonic() - began < 3
            acked += first.result(timeout=15)
        wait_for(lambda: serve.stats().storage.embedded_restarts == 1, 15, "the hung Redis to be replaced")
        wait_for(lambda: serve.stats().storage.journaled_commits == 0, 15, "the journal to drain")
        assert state(hung) == "" and "has not answered for 5 s; killing it" in serve.log()
        _assert_logged_once(serve.redis_url(), acked, range(26))
        assert len(acked) == 26 and len(log_entries(serve.redis_url(), "ns")) == 26
        assert serve.sigterm(STOP_S) == 0
    finally:
        serve.close()


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs to mount a tmpfs (root)")
def test_a_full_disk_refuses_commits_and_recovers_by_itself(tmp_path: Path) -> None:
    with small_disk(tmp_path / "data", "24m") as data:
        serve = _start(data)
        try:
            acked = _commits(serve, range(10))
            filler = fill_disk(data)
            # Redis cannot write its AOF (it exits, by design), the journal cannot either: refused.
            tried = _commits(serve, range(10, 30))
            acked += tried
            # A commit may find Redis gone before its supervisor (polling every 0.1 s) has read
            # why it exited; from then on the outage is reported as a full disk.
            wait_for(lambda: serve.stats().storage.disk_full, 5, "the full disk to be reported")
            health = serve.stats().storage
            assert not health.available and health.disk_full, health
            assert len(tried) < 20  # refused, not acknowledged and dropped
            filler.unlink()  # space returns: the supervisor restarts Redis, commits flow again
            began, i = time.monotonic(), 30
            while not _commit(serve, i):
                assert time.monotonic() - began < 30, "commits still refused 30 s after space returned"
                i += 1
                time.sleep(0.2)
            acked += [i, *_commits(serve, range(i + 1, i + 11))]
            wait_for(lambda: serve.stats().storage.journaled_commits == 0, 15, "the journal to drain")
            # The supervisor counts the restart once its own readiness check (a PING every 50 ms)
            # passes; commits may reach the new server a poll before that.
            wait_for(lambda: serve.stats().storage.embedded_restarts >= 1, 5, "the restart to be counted")
            health = serve.stats().storage
            assert health.available and not health.disk_full and health.embedded_restarts >= 1
            log = serve.log()  # (Redis, on a full disk, may not manage to log why it exits)
            assert "commit refused, not acknowledged" in log and "No space left on device" in log
            _assert_logged_once(serve.redis_url(), acked, range(i + 11))
            assert serve.sigterm(STOP_S) == 0
        finally:
            serve.close()

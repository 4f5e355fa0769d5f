"""``draftcache serve`` stops within its deployments' grace periods whatever Redis does: real
processes, a real Redis frozen with SIGSTOP."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from draftcache.v1 import draftcache_pb2 as pb

from cache_service.app import stop_seconds
from cache_service.config import ServerConfig
from tests.faults import Serve, kill, log_entries, wait_for
from tests.service.test_durability import _assert_logged_once, _commits, _start, _tokens
from tests.service.test_redis_outage import Redis

# SIGTERM to exit: the stop's bound, and a few seconds for the process's own end (and a loaded
# test machine). Before the stop was bounded, a frozen Redis held it for minutes.
STOP_S = stop_seconds(ServerConfig().grace_s) + 5.0


def _open_sessions(serve: Serve, count: int) -> list[str]:
    """``count`` sessions opened and drafted on once (state the write-back owes storage)."""
    prompts = [pb.OpenSession(namespace="ns", prompt=_tokens(1000 + i)[:6]) for i in range(count)]
    ids = list(serve.stub.OpenSessions(pb.OpenSessionsRequest(sessions=prompts), timeout=10).session_ids)
    _draft(serve, ids, 7)
    return ids


def _draft(serve: Serve, ids: list[str], token: int) -> None:
    items = [pb.DraftItem(session_id=sid, new_tokens=[token, token + 1]) for sid in ids]
    serve.stub.Draft(pb.DraftRequest(items=items), timeout=10)


def test_sigterm_with_redis_frozen_stops_within_the_bound_and_keeps_every_commit(tmp_path: Path) -> None:
    """Redis frozen (SIGSTOP: connections accepted, nothing answered) under 50 open sessions:
    SIGTERM ends the service within its stop bound (it took 296 s: the jobs, the last write-back
    and the last sync each waited out the background client's 30 s timeout and its retry); the
    sessions' last changes are given up and counted, and the commit acknowledged while Redis
    was frozen, journaled, is in the log once Redis answers and the service starts again."""
    redis = Redis(tmp_path)
    redis.start()
    assert redis.proc is not None
    frozen = redis.proc.pid
    data = tmp_path / "data"
    try:
        serve = _start(data, "--flush-interval", "0.2", "--follow-interval", "0.2", redis_url=redis.url)
        try:
            acked = _commits(serve, range(2))
            ids = _open_sessions(serve, 50)
            time.sleep(0.5)  # written back
            kill(frozen, signal.SIGSTOP)
            acked += _commits(serve, range(2, 3))  # journaled after the call timeout, acknowledged
            _draft(serve, ids, 9)  # changes the write-back now owes a frozen Redis
            time.sleep(1.0)  # the jobs are held by it
            began = time.monotonic()
            assert serve.sigterm(STOP_S) == 0
            assert time.monotonic() - began < STOP_S
        finally:
            kill(frozen, signal.SIGCONT)
            serve.close()
        log = serve.log()
        assert "the last changes of 50 sessions are lost" in log, log[-3000:]
        assert "1 commits stay in the journal" in log
        serve = Serve(data, redis_url=redis.url).start()  # replays the journal
        try:
            assert len(acked) == 3
            wait_for(lambda: serve.stats().storage.journaled_commits == 0, 30, "the journal replayed")
            _assert_logged_once(redis.url, acked, range(3))
            assert len(log_entries(redis.url, "ns")) == 3
            assert serve.sigterm(STOP_S) == 0
        finally:
            serve.close()
    finally:
        redis.kill()

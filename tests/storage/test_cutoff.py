"""A :class:`Cutoff` ends a storage client's calls on a frozen Redis (SIGSTOP: connections are
accepted, nothing is answered), which would otherwise hold each call for the client's 30 s
socket timeout and then once more for its retry."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from cache_service.storage.connect import CUT_MESSAGE, Cutoff, connect
from cache_service.storage.errors import StorageUnavailable
from cache_service.storage.redis_store import RedisStore
from tests.faults import kill
from tests.service.test_redis_outage import Redis


def test_a_cut_ends_the_calls_a_frozen_redis_holds_and_refuses_later_ones_until_restored(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    redis.start()
    assert redis.proc is not None
    cutoff = Cutoff()
    store = RedisStore(connect(redis.url, cutoff=cutoff))
    store.register_namespace("ns", 100)
    failures: list[tuple[str, float]] = []

    def held(call: str) -> None:
        began = time.monotonic()
        with pytest.raises(StorageUnavailable) as failed:
            store.namespaces() if call == "command" else store.log_size("ns")  # a pipeline
        failures.append((str(failed.value), time.monotonic() - began))

    try:
        kill(redis.proc.pid, signal.SIGSTOP)
        calls = [threading.Thread(target=held, args=(c,)) for c in ("command", "command", "pipeline")]
        for call in calls:
            call.start()
        time.sleep(0.5)  # each waits on its socket
        cutoff.cut()
        for call in calls:
            call.join(2.0)
        assert len(failures) == 3 and all(CUT_MESSAGE in why and 0.4 < s < 2.0 for why, s in failures), failures
        began = time.monotonic()
        with pytest.raises(StorageUnavailable, match=CUT_MESSAGE):
            store.namespaces()  # not sent
        assert time.monotonic() - began < 0.1
        kill(redis.proc.pid, signal.SIGCONT)
        cutoff.restore()
        assert store.namespaces() == {"ns": 100}
        kill(redis.proc.pid, signal.SIGSTOP)
        began = time.monotonic()
        cutoff.cut_at(began + 0.5)
        with pytest.raises(StorageUnavailable, match=CUT_MESSAGE):
            store.namespaces()
        assert 0.4 < time.monotonic() - began < 2.0
    finally:
        kill(redis.proc.pid, signal.SIGCONT)
        redis.kill()

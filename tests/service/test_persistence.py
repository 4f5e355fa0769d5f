"""Persistence hands back data and keeps no hold on the service: what a flush wrote, what other
replicas committed, what an adopted generation covers. StorageSync applies it. On a real Redis."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cache_service.config import EmbeddedRedisConfig, ServiceConfig
from cache_service.domain.service import DraftService
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.persistence import RedisPersistence
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from cache_service.sync import StorageSync


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisStore]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    yield RedisStore(connect(server.url))
    server.stop()


def _tokens(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def test_commits_come_back_as_written_and_only_others_are_followed(store: RedisStore) -> None:
    mine, theirs = RedisPersistence(store, max_pending=10), RedisPersistence(store, max_pending=10)
    mine.read_log("a")  # both follow the log from its start
    theirs.read_log("a")
    (logged,), _ = mine.requests_committed("a", [_tokens(1, 2), _tokens(3)], ["k1" * 8, ""])
    ns, requests, ids = logged
    assert ns == "a" and [r.tolist() for r in requests] == [[1, 2], [3]] and ids[0] < ids[1]
    assert mine.follow("a") == ([], [], [])  # its own entries are skipped
    got, at, keys = theirs.follow("a")
    assert [r.tolist() for r in got] == [[1, 2], [3]] and at == ids and keys == ["k1" * 8]
    assert theirs.follow("a") == ([], [], [])  # each entry once
    ((_, _, fourth),), _ = theirs.requests_committed("a", [_tokens(4)], ["k4" * 8])
    theirs.requests_committed("a", [_tokens(5)], ["k5" * 8])
    later = mine.follow("a", covered=fourth[0])  # entries up to covered are indexed already
    assert [r.tolist() for r in later.tokens] == [[5]] and later.keys == ["k4" * 8, "k5" * 8]  # keys of both held


def test_skip_to_moves_the_cursor_past_a_generation(store: RedisStore) -> None:
    mine, theirs = RedisPersistence(store, max_pending=10), RedisPersistence(store, max_pending=10)
    mine.read_log("a")
    ((_, _, ids),), _ = theirs.requests_committed("a", [_tokens(1), _tokens(2), _tokens(3)])
    mine.skip_to("a", ids[1])
    assert [r.tolist() for r in mine.follow("a").tokens] == [[3]]


def test_sync_applies_what_persistence_reads(store: RedisStore) -> None:
    other = RedisPersistence(store, max_pending=10)
    store.register_namespace("a", 10)
    other.requests_committed("a", [_tokens(1, 2, 3)])
    persistence = RedisPersistence(store, max_pending=10)
    service = DraftService(ServiceConfig(), persistence)
    sync = StorageSync(service, persistence, None)
    sync.restore()  # the namespace and its log, from storage
    assert service.namespace_names() == ["a"] and service.namespace("a").memory.requests == 1
    store.register_namespace("b", 20)  # registered elsewhere
    other.requests_committed("a", [_tokens(4, 5)])
    sync.sync()
    assert service.namespace_names() == ["a", "b"] and service.namespace("a").memory.requests == 2
    assert all(held is not service for held in vars(persistence).values())  # no hold on the service


def test_forgetting_a_namespace_does_not_wait_on_a_follow_a_hung_storage_holds(tmp_path: Path) -> None:
    """A follow waiting on a frozen Redis (the background client's timeout: 3 s here, 30 s by
    default) holds nothing that forgetting a namespace, as DeleteNamespace does, waits on: it
    returns at once (it waited out the follow's read). The read, once answered, is not taken
    across the forgetting, and the next follow reads on from where the cursor is."""
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    try:
        mine = RedisPersistence(RedisStore(connect(server.url, socket_timeout=3.0)), max_pending=10)
        theirs = RedisPersistence(RedisStore(connect(server.url)), max_pending=10)
        mine.read_log("a")
        theirs.requests_committed("a", [_tokens(1, 2)])
        pid = int((tmp_path / "server.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                following = pool.submit(mine.follow, "a")
                time.sleep(0.3)  # the follow is waiting on storage
                began = time.monotonic()
                mine.namespace_forgotten("b")
                waited = time.monotonic() - began
                assert not following.done()
                os.kill(pid, signal.SIGCONT)
                assert following.result(10) == ([], [], [])  # read across a forgetting: not taken
        finally:
            os.kill(pid, signal.SIGCONT)
        assert waited < 1.0
        assert [r.tolist() for r in mine.follow("a").tokens] == [[1, 2]]
        assert mine.follow("a") == ([], [], [])
    finally:
        server.stop()

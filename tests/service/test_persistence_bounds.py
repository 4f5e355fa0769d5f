"""What persistence keeps per namespace and per entry of its own does not outlive them: names
created and deleted for weeks, and entries trimmed from the log before they were followed, leave
nothing behind in the process. On a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cache_service.config import EmbeddedRedisConfig
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.persistence import RedisPersistence
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore, StoreConfig


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    yield server.url
    server.stop()


def _held(p: RedisPersistence) -> int:
    """Cursors and own entry ids the persistence holds."""
    return len(p._last) + len(p._successors_seen) + sum(len(own) for own in p._own.values())


def test_deleted_namespaces_leave_no_cursors_behind(url: str) -> None:
    store = RedisStore(connect(url))
    mine, other = RedisPersistence(store, max_pending=10), RedisPersistence(store, max_pending=10)
    for i in range(20):  # names come and go; each is followed, and holds a commit not yet followed
        name = f"ns-{i}"
        store.register_namespace(name, 10)
        mine.read_log(name)
        mine.read_successors(name)
        other.read_log(name)
        mine.requests_committed(name, [np.arange(3, dtype=np.int32)])
        if i % 2:
            mine.namespace_deleted(name)  # deleted here
        else:
            store.delete_namespace(name)  # deleted by another replica: this one forgets it
            mine.namespace_forgotten(name)
        other.namespace_forgotten(name)
    assert _held(mine) == 0 and _held(other) == 0


def test_own_entries_trimmed_before_they_were_followed_are_forgotten(url: str) -> None:
    store = RedisStore(connect(url), StoreConfig(max_log_tokens=8))
    mine = RedisPersistence(store, max_pending=10)
    mine.read_log("a")
    for i in range(10):  # 30 tokens into a log of 8: most are trimmed before anyone reads them
        mine.requests_committed("a", [np.full(3, i, dtype=np.int32)])
    assert mine.follow("a") == ([], [], [])  # its own entries, those still there, skipped
    assert sum(len(own) for own in mine._own.values()) == 0
    other = RedisPersistence(store, max_pending=10)
    other.requests_committed("a", [np.full(3, 7, dtype=np.int32)])
    assert [r.tolist() for r in mine.follow("a")[0]] == [[7, 7, 7]]  # following goes on

"""A Redis that dies: calls fail fast as StorageUnavailable; an AOF restart brings data back.

One server only, by nature (it kills and restarts that server); a cluster master that dies and
returns is in test_cluster.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache_service.storage import RedisStore, StorageUnavailable, errors
from tests.storage.conftest import stored
from tests.storage.servers import RedisServer


def _fast_failing_client(url: str) -> redis.Redis:
    # What an entry point should build: short timeouts and a bounded retry, so a dead Redis
    # costs a request milliseconds, not the default ten retries with backoff.
    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 1))


def test_killed_server_fails_fast_and_restarts_with_its_data(dedicated_server: Callable[..., RedisServer]) -> None:
    server = dedicated_server("--appendonly", "yes", "--appendfsync", "always")
    store = RedisStore(_fast_failing_client(server.url))
    store.register_namespace("n", 32000)
    ids = store.append_requests("n", [np.array([1, 2, 3], np.int32), np.array([4], np.int32)])
    version = store.put_prior("n", b"prior" * 1000)
    store.save_session("s", stored([1, 2, 3], 2, [((1,), [((2, 3), 4)])]), ttl_s=600)

    server.kill()
    calls = [
        store.ping,
        lambda: store.append_requests("n", [np.array([5], np.int32)]),
        lambda: store.read_log("n"),
        lambda: store.load_session("s"),
        lambda: store.prior_version("n"),
    ]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(StorageUnavailable):
            call()
        assert time.monotonic() - start < 2.0

    server.start()  # same port, same directory: replays the AOF
    assert [e.id for e in store.read_log("n")] == ids
    assert store.log_size("n") == (2, 4)
    store.append_requests("n", [np.array([5], np.int32)])  # the restarted server lost the script cache
    assert store.log_size("n") == (3, 5)
    assert store.namespaces() == {"n": 32000}
    assert store.get_prior("n") == (version, b"prior" * 1000)
    loaded = store.load_session("s")
    assert loaded is not None and loaded.snapshot.rejected.items() == [((1,), [((2, 3), 4)])]
    assert loaded.snapshot.context.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "exc",
    [
        redis.BusyLoadingError("loading"),
        redis.ReadOnlyError("READONLY"),
        redis.TimeoutError("t"),
        redis.ConnectionError(),
    ],
)
def test_transient_redis_errors_map_to_unavailable(exc: redis.RedisError) -> None:
    assert isinstance(errors.translate(exc), StorageUnavailable)


def test_other_redis_errors_are_not_disguised() -> None:
    assert errors.translate(redis.ResponseError("ERR wrong number of arguments")) is None

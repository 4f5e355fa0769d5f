"""Start-up work that must not land on the serving event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.config import EmbeddedRedisConfig
from cache_service.host.embedded_redis import EmbeddedRedis
from indexer import kernels
from tests.service.conftest import Replica


def test_kernels_are_compiled_off_the_event_loop_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    compile_all = kernels.warm_up

    def recording() -> None:
        threads.append(threading.get_ident())
        compile_all()

    monkeypatch.setattr(kernels, "warm_up", recording)
    redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    replica = Replica(redis.url)  # fresh storage: no namespace to restore
    try:

        async def ident() -> int:
            return threading.get_ident()

        loop_thread = asyncio.run_coroutine_threadsafe(ident(), replica.loop).result(5)
        # Compiled once while starting, on a worker thread: nothing had asked for a namespace yet.
        assert threads and loop_thread not in threads
        started = len(threads)
        replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns", vocab_size=100), timeout=10)
        # Creating a namespace (its own warm-up, instant now, and its registration in storage)
        # runs on a worker thread too.
        assert len(threads) == started + 1 and threads[-1] != loop_thread
    finally:
        replica.stop()
        redis.stop()

"""Commits: the requests one close call commits join the lifetime memory together (one index
run) and the shared log in one append, in order, each with its exact prompt -> response entry.
On a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_service.config import EmbeddedRedisConfig, ServiceConfig
from cache_service.domain.errors import InvalidArgument, Unavailable
from cache_service.domain.items import CloseItem, DraftItem, OpenItem
from cache_service.domain.service import DraftService
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.persistence import RedisPersistence
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from indexer import lifetime_index
from indexer.lifetime_index import prompt_key


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisStore]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    yield RedisStore(connect(server.url))
    server.stop()


def _log(store: RedisStore, ns: str) -> list[list[int]]:
    return [list(entry.tokens) for entry in store.read_log(ns)]


def test_one_close_call_commits_its_requests_together(store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    persistence = RedisPersistence(store, max_pending=100)
    svc = DraftService(ServiceConfig(), persistence)
    svc.create_namespace("a", 100)
    svc.create_namespace("b", 100)
    prompts = {"a": [[1, 2, 3], [4, 5, 6], [7, 8, 9]], "b": [[10, 11, 12]]}
    sids = {ns: svc.open([OpenItem(ns, p) for p in ps]) for ns, ps in prompts.items()}
    for ids in sids.values():
        svc.draft_ahead([DraftItem(sid, np.array([40 + i, 50], dtype=np.int32)) for i, sid in enumerate(ids)])
    built: list[int] = []

    class Counted(lifetime_index.SuffixIndex):
        def __init__(self, tokens: np.ndarray) -> None:
            built.append(tokens.size)
            super().__init__(tokens)

    monkeypatch.setattr(lifetime_index, "SuffixIndex", Counted)
    # Sessions of two namespaces close in one call: one commit job per namespace, then their
    # stored copies deleted.
    jobs = svc.close([CloseItem(sid) for ids in sids.values() for sid in ids])
    assert len(jobs) == 3
    for job in jobs:
        job()
    memory = svc.namespace("a").memory
    # One suffix array per namespace, over all of its requests (one by one, "a" alone takes 5:
    # a run per request and two merges).
    assert sorted(built) == [6, 18] and memory.requests == 3
    # Each request is in the log in close order, and each prompt maps to its own response.
    assert _log(store, "a") == [[*p, 40 + i, 50] for i, p in enumerate(prompts["a"])]
    assert _log(store, "b") == [[10, 11, 12, 40, 50]]
    for i, p in enumerate(prompts["a"]):
        got = memory.exact_response(prompt_key(np.array(p, dtype=np.int32)))
        assert got is not None and got.tolist() == [40 + i, 50]
    assert persistence.pending == 0


def test_commits_queued_while_storage_is_down_are_written_in_order(tmp_path: Path) -> None:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=True)).start()
    store = RedisStore(connect(server.url))
    for ns in ("a", "b"):  # registered, as the service's namespaces always are before commits
        store.register_namespace(ns, 1000)
    persistence = RedisPersistence(store, max_pending=5)
    requests = [np.array([i, i + 1], dtype=np.int32) for i in range(4)]
    server.stop()  # storage goes away: commits queue up in order
    persistence.requests_committed("a", requests[:2])
    persistence.requests_committed("b", requests[2:3])
    persistence.requests_committed("a", requests[3:])
    assert persistence.pending == 4
    # The queue is bounded: past max_pending a commit is refused, not dropped silently.
    with pytest.raises(Unavailable, match="waiting for storage"):
        persistence.requests_committed("a", requests[:2])
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=True, port=server.port)).start()
    calls: list[tuple[str, int]] = []
    append = store.append_commits

    def counted(ns: str, batch: list[tuple[bytes, int, np.ndarray]], **options: Any) -> list[str | None]:
        calls.append((ns, len(batch)))
        return append(ns, batch, **options)

    store.append_commits = counted  # type: ignore[method-assign]
    try:
        # While storage was last seen down a commit waits behind the queue; the next flush
        # (the background sync's) writes both.
        persistence.requests_committed("b", [np.array([9], dtype=np.int32)])
        assert calls == [] and persistence.pending == 5
        persistence.flush()
        # Runs of one namespace go in one append each, in queue order.
        assert calls == [("a", 2), ("b", 1), ("a", 1), ("b", 1)]
        assert _log(store, "a") == [[0, 1], [1, 2], [3, 4]]
        assert _log(store, "b") == [[2, 3], [9]]
        assert persistence.pending == 0
    finally:
        server.stop()


def test_a_close_brings_the_last_steps_tokens_into_the_commit(store: RedisStore) -> None:
    svc = DraftService(ServiceConfig(), RedisPersistence(store, max_pending=100))
    svc.create_namespace("a", 100)
    first, second = svc.open([OpenItem("a", [1, 2, 3]), OpenItem("a", [4, 5])])
    svc.draft_ahead([DraftItem(first, np.array([7], dtype=np.int32)), DraftItem(second, np.array([8], np.int32))])
    # A bad close changes nothing: a token outside the vocabulary, a session named twice.
    for bad in (
        [CloseItem(first, new_tokens=[9]), CloseItem(second, new_tokens=[100])],
        [CloseItem(first, new_tokens=[9]), CloseItem(first)],
        [CloseItem(first, commit_from=6, new_tokens=[9])],  # past the context with its new tokens
    ):
        with pytest.raises(InvalidArgument):
            svc.close(bad)
    assert svc.sessions.holds(first) and svc.sessions.holds(second)
    assert svc.sessions.get(first).session.context.tokens.tolist() == [1, 2, 3, 7]
    for job in svc.close([CloseItem(first, commit_from=5, new_tokens=[9, 10]), CloseItem(second, new_tokens=[11])]):
        job()
    assert _log(store, "a") == [[10], [4, 5, 8, 11]]  # each request with the tokens its close brought
    assert not svc.sessions.holds(first) and not svc.sessions.holds(second)

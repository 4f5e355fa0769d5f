"""Session write-back: a session storage holds is sent as what it gained (new tokens, and its
rejected table when due), not whole; anything storage did not take is written whole next time.
The domain side is checked on a plain DraftService; the round trip on a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cache_service.config import EmbeddedRedisConfig, ServiceConfig
from cache_service.domain.changes import SessionDelta
from cache_service.domain.errors import NotFound
from cache_service.domain.items import CloseItem, DraftItem, OpenItem
from cache_service.domain.service import DraftService
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.persistence import RedisPersistence
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from cache_service.storage.stored_session import StoredSession

PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]


def _service(**kw: float) -> DraftService:
    svc = DraftService(ServiceConfig(**kw))  # type: ignore[arg-type]
    svc.create_namespace("toy", 100)
    return svc


def _step(svc: DraftService, sid: str, new: list[int]) -> None:
    svc.draft_ahead([DraftItem(sid, np.array(new, dtype=np.int32))])


def test_whole_first_then_only_the_new_tokens() -> None:
    svc = _service(table_flush_interval_s=3600)
    (sid,) = svc.open([OpenItem("toy", PROMPT)])
    changed, closed = svc.take_changes()
    assert closed == [] and [s for s, _ in changed] == [sid]
    assert isinstance(changed[0][1], StoredSession) and changed[0][1].snapshot.context.tolist() == PROMPT
    assert svc.take_changes() == ([], [])  # nothing new
    _step(svc, sid, [])
    _step(svc, sid, [7, 8])  # new tokens: appended after the 10 storage holds
    ((_, delta),) = svc.take_changes()[0]
    assert isinstance(delta, SessionDelta) and delta.held == 10 and delta.tokens.tolist() == [7, 8]
    _step(svc, sid, [9])
    ((_, delta),) = svc.take_changes()[0]
    assert isinstance(delta, SessionDelta) and delta.held == 12 and delta.tokens.tolist() == [9]


def test_a_changed_table_waits_for_its_interval_and_keeps_the_session_pending() -> None:
    svc = _service(table_flush_interval_s=0.3)
    (sid,) = svc.open([OpenItem("toy", PROMPT)])
    svc.take_changes()
    _step(svc, sid, [])  # a tree to verify
    _step(svc, sid, [6])  # its branches were rejected: the table changed
    ((_, delta),) = svc.take_changes()[0]
    assert isinstance(delta, SessionDelta) and delta.tokens.tolist() == [6] and delta.rejected is None
    # Not due yet: nothing to write, but the session stays pending (and in memory).
    assert svc.take_changes() == ([], [])
    assert svc.changes.pending(sid)
    time.sleep(0.35)
    ((_, delta),) = svc.take_changes()[0]
    assert isinstance(delta, SessionDelta) and delta.tokens.size == 0
    assert delta.rejected is not None and delta.rejected.items() == svc.sessions.get(sid).session.rejected.table.items()
    assert len(delta.rejected)
    assert svc.take_changes() == ([], []) and not svc.changes.pending(sid)


def test_final_takes_every_table_and_requeue_rewrites_whole() -> None:
    svc = _service(table_flush_interval_s=3600)
    (sid,) = svc.open([OpenItem("toy", PROMPT)])
    svc.take_changes()
    _step(svc, sid, [])
    _step(svc, sid, [6])
    svc.take_changes()
    ((_, delta),) = svc.take_changes(final=True)[0]  # stopping: the pending table goes now
    assert isinstance(delta, SessionDelta) and delta.rejected
    svc.requeue([sid])  # storage did not take it: whole next time, whatever it held
    ((_, whole),) = svc.take_changes()[0]
    assert isinstance(whole, StoredSession) and whole.snapshot.context.tolist() == [*PROMPT, 6]
    svc.requeue(["unknown-session"])  # an id that is gone meanwhile is skipped


def _taken(changed: list) -> dict[str, tuple]:  # type: ignore[type-arg]
    """What a list of changes says, by session: whole contexts, or appended tokens and tables."""
    out = {}
    for sid, change in changed:
        if isinstance(change, StoredSession):
            out[sid] = ("whole", change.snapshot.context.tolist(), change.snapshot.rejected)
        else:
            out[sid] = ("delta", change.held, change.tokens.tolist(), change.rejected)
    return out


def test_a_round_taken_in_slices_takes_what_one_call_takes() -> None:
    """The serving loop takes a write-back round a slice at a time (calls are served between
    slices): the slices together take what one call takes, and a session changed between two
    slices, before or after its own, loses nothing."""
    at_once, sliced = _service(table_flush_interval_s=0.0), _service(table_flush_interval_s=0.0)
    prompts = [OpenItem("toy", [*PROMPT, i % 50]) for i in range(40)]
    ids = at_once.open(prompts)
    assert sliced.open([OpenItem(p.namespace, p.prompt, session_id=sid) for p, sid in zip(prompts, ids, strict=True)])
    for svc in (at_once, sliced):
        svc.take_changes()
        for i, sid in enumerate(ids):  # every session gains tokens, some a rejected table too
            _step(svc, sid, [])
            _step(svc, sid, [6, i % 7])
    whole = _taken(at_once.take_changes()[0])
    slices = []
    while not slices or sliced.taking:
        slices.append(_taken(sliced.take_changes(budget_s=0.0)[0]))  # no budget: one session a slice
    assert len(slices) == len(ids) and {k: v for part in slices for k, v in part.items()} == whole
    assert not len(sliced.changes) and sliced.take_changes() == ([], [])

    # Changes between slices: a session already taken gains tokens (taken next round), one not
    # yet taken gains tokens (taken with the rest in its slice); none is taken twice or lost.
    for svc in (at_once, sliced):
        for sid in ids:
            _step(svc, sid, [8])
    first = _taken(sliced.take_changes(budget_s=0.0)[0])
    _step(sliced, next(iter(first)), [9])  # taken this round already
    later = [sid for sid in ids if sid not in first]
    _step(sliced, later[-1], [9])  # still to be taken this round
    rest = {}
    while sliced.taking:
        rest.update(_taken(sliced.take_changes(budget_s=0.0)[0]))
    assert rest[later[-1]][2] == [8, 9] and next(iter(first)) not in rest
    ((again, delta),) = sliced.take_changes()[0]  # the next round: the one taken early
    assert again == next(iter(first)) and isinstance(delta, SessionDelta) and delta.tokens.tolist() == [9]


def test_a_slice_stops_at_its_budget() -> None:
    svc = _service(table_flush_interval_s=3600)
    ids = svc.open([OpenItem("toy", PROMPT) for _ in range(30)])
    changed, _ = svc.take_changes(budget_s=3600.0)  # room for all
    assert len(changed) == 30 and not svc.taking
    for sid in ids:
        _step(svc, sid, [5])
    changed, _ = svc.take_changes(budget_s=0.0)
    assert len(changed) == 1 and svc.taking and len(svc.changes) == 29  # the rest stay changed


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisStore]:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    yield RedisStore(connect(server.url))
    server.stop()


def test_round_trip_and_recovery_from_lost_storage(store: RedisStore) -> None:
    svc = _service(table_flush_interval_s=0.0)
    persistence = RedisPersistence(store, max_pending=100)
    (sid,) = svc.open([OpenItem("toy", PROMPT)])

    def flush() -> list[str]:
        changed, closed = svc.take_changes()
        saved = persistence.save_sessions(changed, closed, ttl_s=60)
        svc.saved(saved)
        return saved.missed

    assert flush() == []
    for new in ([], [6], [7, 8], [9]):
        _step(svc, sid, new)
        assert flush() == []
    live = svc.sessions.get(sid).session
    got = store.load_session(sid)
    assert got is not None and got.snapshot.context.tolist() == [*PROMPT, 6, 7, 8, 9] == live.context.tokens.tolist()
    assert got.snapshot.rejected.items() == live.rejected.table.items() and len(got.snapshot.rejected)
    # Storage loses everything (a restart without persistence): the next append is refused and
    # the session is written whole on the following flush.
    store.client.flushdb()
    _step(svc, sid, [10])
    assert flush() == [sid]
    assert flush() == []
    got = store.load_session(sid)
    assert got is not None and got.snapshot.context.tolist() == [*PROMPT, 6, 7, 8, 9, 10]
    assert got.snapshot.rejected.items() == svc.sessions.get(sid).session.rejected.table.items()


def test_a_closed_session_does_not_come_back_from_the_copy_storage_still_keeps(store: RedisStore) -> None:
    """A session closed here keeps its stored copy until the next write-back deletes it; a call
    naming it meanwhile is told it is unknown, as after, and does not continue that copy (it
    did: a closed session came back, and a client that closed it found it drafting again)."""
    persistence = RedisPersistence(store, max_pending=100)
    svc = DraftService(ServiceConfig(table_flush_interval_s=0.0), persistence)
    svc.create_namespace("toy", 100)
    (sid,) = svc.open([OpenItem("toy", PROMPT)])

    def flush() -> None:
        changed, closed = svc.take_changes()
        svc.saved(persistence.save_sessions(changed, closed, ttl_s=60))

    flush()
    assert store.load_session(sid) is not None
    svc.close([CloseItem(sid, commit=False)])
    assert store.load_session(sid) is not None  # the write-back has not run yet
    with pytest.raises(NotFound):
        _step(svc, sid, [6])
    svc.continue_stored(svc.read_stored([sid]))  # the servicer's way: read off the serving thread
    assert not svc.sessions.holds(sid)
    flush()
    assert store.load_session(sid) is None
    with pytest.raises(NotFound):
        _step(svc, sid, [6])


def test_a_session_closed_on_one_replica_is_not_continued_on_another(store: RedisStore) -> None:
    """Two replicas on one storage: a session closed on the first is unknown to the second the
    moment the close is answered (its stored copy deleted with the close, not at the first
    replica's next write-back, until which the second continued it: a closed session came
    back there). A close while storage is known down leaves the copy to the write-back."""
    persistence = RedisPersistence(store, max_pending=100)
    first = DraftService(ServiceConfig(table_flush_interval_s=0.0), persistence)
    second = DraftService(ServiceConfig(table_flush_interval_s=0.0), RedisPersistence(store, max_pending=100))
    for svc in (first, second):
        svc.create_namespace("toy", 100)
    a, b = first.open([OpenItem("toy", PROMPT), OpenItem("toy", PROMPT)])

    def flush() -> None:
        changed, closed = first.take_changes()
        first.saved(persistence.save_sessions(changed, closed, ttl_s=60))

    flush()
    assert store.load_session(a) is not None and store.load_session(b) is not None
    for job in first.close([CloseItem(a, commit=False)]):  # run as the servicer runs them, before answering
        job()
    assert store.load_session(a) is None
    assert second.read_stored([a]) == {}
    with pytest.raises(NotFound):
        _step(second, a, [6])
    persistence.commits.status.failed("Connection refused")
    for job in first.close([CloseItem(b, commit=False)]):
        job()
    assert store.load_session(b) is not None
    persistence.commits.status.succeeded()
    flush()
    assert store.load_session(b) is None

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.lifetime_buffer import LifetimeBuffer
from indexer.tokens import SEPARATOR

S = int(SEPARATOR)


def _a(*ids):
    return np.array(ids, dtype=np.int32)


def test_empty_buffer_snapshot_is_empty():
    buf = LifetimeBuffer(capacity=4)
    # Nothing appended yet: no tokens and no separators.
    assert buf.snapshot().tolist() == []
    assert (buf.size, buf.requests, buf.appended) == (0, 0, 0)


def test_requests_are_followed_by_separators():
    buf = LifetimeBuffer(capacity=16)
    buf.append(_a(1, 2, 3))
    buf.append(_a(4, 5))
    # Each request ends with a separator so matches never cross requests.
    assert buf.snapshot().tolist() == [1, 2, 3, S, 4, 5, S]
    # 3 + 1 + 2 + 1 tokens written, two requests.
    assert (buf.size, buf.appended, buf.requests) == (7, 7, 2)


def test_empty_request_stores_only_its_separator():
    buf = LifetimeBuffer(capacity=8)
    buf.append(_a(1))
    buf.append(_a())
    # The empty request contributes only its separator.
    assert buf.snapshot().tolist() == [1, S, S]


def test_exactly_full_ring_snapshot_in_order():
    buf = LifetimeBuffer(capacity=4)
    buf.append(_a(1, 2, 3))
    # 3 tokens + separator fill the ring exactly; nothing is lost.
    assert buf.snapshot().tolist() == [1, 2, 3, S]


def test_wrap_around_overwrites_oldest_tokens_and_keeps_order():
    buf = LifetimeBuffer(capacity=6)
    buf.append(_a(1, 2, 3))  # 1 2 3 S
    buf.append(_a(4, 5))  # 4 5 S wraps: 1 is overwritten
    # The newest 6 of [1 2 3 S 4 5 S] remain, oldest first.
    assert buf.snapshot().tolist() == [2, 3, S, 4, 5, S]
    # size saturates at capacity while appended keeps counting.
    assert (buf.size, buf.appended, buf.requests) == (6, 7, 2)


def test_multiple_wraps_keep_newest_tokens():
    buf = LifetimeBuffer(capacity=5)
    for r in ([1, 2], [3, 4], [5, 6], [7]):
        buf.append(np.array(r, dtype=np.int32))
    # Stream is 1 2 S 3 4 S 5 6 S 7 S; the last 5 survive.
    assert buf.snapshot().tolist() == [5, 6, S, 7, S]


def test_request_longer_than_capacity_keeps_its_tail():
    buf = LifetimeBuffer(capacity=4)
    buf.append(_a(1, 2, 3, 4, 5, 6, 7))
    # Only capacity - 1 tail tokens fit beside the separator.
    assert buf.snapshot().tolist() == [5, 6, 7, S]
    # Only what was written counts as appended.
    assert buf.appended == 4


def test_request_of_exactly_capacity_keeps_its_tail():
    buf = LifetimeBuffer(capacity=3)
    buf.append(_a(1, 2, 3))
    # 3 tokens + separator exceed 3 slots: the head token 1 is dropped.
    assert buf.snapshot().tolist() == [2, 3, S]


def test_snapshot_is_a_copy():
    buf = LifetimeBuffer(capacity=6)
    buf.append(_a(1, 2))
    snap = buf.snapshot()
    buf.append(_a(3, 4))
    buf.append(_a(5, 6))
    # The first snapshot still shows only the first request.
    assert snap.tolist() == [1, 2, S]
    # And it is not a view of the ring.
    snap[0] = 99
    assert 99 not in buf.snapshot().tolist()


def test_snapshot_of_full_ring_is_a_copy():
    buf = LifetimeBuffer(capacity=4)
    buf.append(_a(1, 2, 3))
    snap = buf.snapshot()
    buf.append(_a(8, 9))
    # The snapshot taken at full capacity is unaffected by the wrap that followed.
    assert snap.tolist() == [1, 2, 3, S]


@pytest.mark.parametrize("cap", [-1, 0, 1])
def test_capacity_below_two_is_rejected(cap):
    # A token and its separator need two slots.
    with pytest.raises(ValueError, match="capacity"):
        LifetimeBuffer(capacity=cap)


def test_capacity_two_works():
    buf = LifetimeBuffer(capacity=2)
    buf.append(_a(7, 8, 9))
    # One token plus its separator fit.
    assert buf.snapshot().tolist() == [9, S]
    assert buf.capacity == 2


@pytest.mark.parametrize(
    "bad", [np.array([1, 2], dtype=np.int64), np.array([1.0], dtype=np.float32), np.zeros((2, 2), dtype=np.int32)]
)
def test_append_rejects_non_1d_int32(bad):
    buf = LifetimeBuffer(capacity=8)
    # Only validated 1-D int32 arrays may be stored.
    with pytest.raises(ValueError, match="int32"):
        buf.append(bad)
    # A rejected append leaves the buffer untouched.
    assert buf.snapshot().tolist() == []


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(2, 12),
    requests=st.lists(st.lists(st.integers(0, 9), max_size=15), max_size=8),
)
def test_snapshot_is_tail_of_written_stream(cap, requests):
    buf = LifetimeBuffer(capacity=cap)
    stream: list[int] = []
    for r in requests:
        buf.append(np.array(r, dtype=np.int32))
        # A request too long for the ring keeps its last cap - 1 tokens.
        stream += (r[-(cap - 1) :] if len(r) >= cap else r) + [S]
    # The snapshot is always the newest min(cap, len(stream)) tokens of what was written, in order.
    assert buf.snapshot().tolist() == stream[-cap:]
    assert buf.appended == len(stream)
    assert buf.size == min(cap, len(stream))
    assert buf.requests == len(requests)

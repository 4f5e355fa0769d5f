import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.session_cache import LruTable, LruTableConfig, RejectedCache


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _table(**kw):
    return LruTable(LruTableConfig(**kw))


# -- LruTableConfig --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["leader_len", "follower_len", "max_leaders", "max_followers"])
def test_config_rejects_zero(name):
    # Every size must be at least 1.
    with pytest.raises(ValueError, match=name):
        LruTableConfig(**{name: 0})


# -- LruTable --------------------------------------------------------------------------------


def test_counts_accumulate_and_most_recent_first():
    t = _table(leader_len=1, follower_len=2)
    t.add((1,), (2, 3))
    t.add((1,), (2, 4))
    t.add((1,), (2, 3), count=5)
    # (2, 3) was seen 1 + 5 times and touched last, so it comes first.
    assert t.followers((1,)) == [((2, 3), 6), ((2, 4), 1)]


def test_unknown_leader_has_no_followers():
    t = _table()
    # Nothing stored for it.
    assert t.followers((9, 9)) == []
    # A miss does not create an entry.
    assert len(t) == 0


def test_max_leaders_evicts_least_recently_used():
    t = _table(leader_len=1, max_leaders=2)
    t.add((1,), (10,))
    t.add((2,), (20,))
    t.add((3,), (30,))
    # Three leaders, room for two: the oldest, (1,), is gone.
    assert t.followers((1,)) == []
    assert len(t) == 2


def test_lookup_does_not_reorder_so_the_table_depends_on_adds_only():
    t = _table(leader_len=1, max_leaders=2)
    t.add((1,), (10,))
    t.add((2,), (20,))
    # Reading (1,) changes nothing...
    assert t.followers((1,)) == [((10,), 1)]
    t.add((3,), (30,))
    # ...so (1,), the least recently added, is evicted: replaying the adds rebuilds the table.
    assert t.followers((1,)) == []
    assert t.followers((2,)) == [((20,), 1)]
    assert t.followers((3,)) == [((30,), 1)]


def test_add_refreshes_leader_so_it_survives_eviction():
    t = _table(leader_len=1, max_leaders=2)
    t.add((1,), (10,))
    t.add((2,), (20,))
    t.add((1,), (11,))
    t.add((3,), (30,))
    # Updating (1,) refreshed it; (2,) was the least recently used.
    assert [lead for lead, _ in t.items()] == [(1,), (3,)]


def test_max_followers_evicts_least_recent_follower():
    t = _table(leader_len=1, max_followers=2)
    t.add((1,), (10,))
    t.add((1,), (11,))
    t.add((1,), (10,))  # refresh (10,)
    t.add((1,), (12,))
    # Room for two followers: (11,) was the least recently updated, so it went.
    assert t.followers((1,)) == [((12,), 1), ((10,), 2)]


def test_evicted_follower_restarts_its_count():
    t = _table(leader_len=1, max_followers=1)
    t.add((1,), (10,), count=3)
    t.add((1,), (11,))
    t.add((1,), (10,))
    # (10,) was evicted by (11,), so its old count of 3 is forgotten.
    assert t.followers((1,)) == [((10,), 1)]


def test_items_replay_rebuilds_same_table():
    t = _table(leader_len=1, max_leaders=3, max_followers=2)
    for lead, fol in [((1,), (2,)), ((2,), (3,)), ((1,), (4,)), ((3,), (5,)), ((1,), (2,))]:
        t.add(lead, fol)
    copy = _table(leader_len=1, max_leaders=3, max_followers=2)
    for lead, fols in t.items():
        for fol, count in fols:
            copy.add(lead, fol, count)
    # items() is oldest first, so replaying it through add() reproduces order and counts.
    assert copy.items() == t.items()
    assert t.items() == [((2,), [((3,), 1)]), ((3,), [((5,), 1)]), ((1,), [((4,), 1), ((2,), 2)])]


def test_candidates_rows_and_weights():
    t = _table(leader_len=2, follower_len=3)
    t.add((4, 5), (6,))
    t.add((4, 5), (6, 7, 8), count=2)
    rows, weights = t.candidates(_a([1, 4, 5]))
    # Most recent follower first, -1 padded to follower_len, weighted by its count.
    assert rows.tolist() == [[6, 7, 8], [6, -1, -1]]
    assert weights.tolist() == [2.0, 1.0]
    assert rows.dtype == np.int32


def test_candidates_miss_and_short_context():
    t = _table(leader_len=2, follower_len=3)
    t.add((4, 5), (6,))
    # Unknown leader: no candidates.
    assert t.candidates(_a([5, 4])) is None
    # Context shorter than the leader: none either.
    assert t.candidates(_a([5])) is None


def _check_against_model(t: LruTable, ops, leader_len: int) -> None:
    cfg = t.config
    model: dict = {}  # leader -> {follower: count}, both in update order (dicts keep insertion order)
    for lead, fol, is_read in ops:
        leader = (lead,) * leader_len
        if is_read:  # reads never reorder
            assert t.followers(leader) == list(reversed(model.get(leader, {}).items()))
            continue
        t.add(leader, (fol,))
        fols = model.pop(leader, {})
        fols[(fol,)] = fols.pop((fol,), 0) + 1
        if len(fols) > cfg.max_followers:
            fols.pop(next(iter(fols)))
        model[leader] = fols
        if len(model) > cfg.max_leaders:
            model.pop(next(iter(model)))
        # Capacities are never exceeded.
        assert len(t) == len(model) <= cfg.max_leaders
        assert all(len(f) <= cfg.max_followers for _, f in t.items())
    # The table behaves exactly like a two-level least-recently-updated map with counts.
    assert t.items() == [(lead, list(fols.items())) for lead, fols in model.items()]
    # Every leader it holds is found by its key, every other one is not.
    for lead in {op[0] for op in ops}:
        leader = (lead,) * leader_len
        assert t.followers(leader) == list(reversed(model.get(leader, {}).items()))


@settings(max_examples=150, deadline=None)
@given(
    max_leaders=st.integers(1, 4),
    max_followers=st.integers(1, 3),
    ops=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4), st.booleans()), max_size=60),
)
def test_capacities_hold_under_many_operations(max_leaders, max_followers, ops):
    t = _table(leader_len=1, follower_len=1, max_leaders=max_leaders, max_followers=max_followers)
    _check_against_model(t, ops, 1)


@settings(max_examples=60, deadline=None)
@given(
    max_leaders=st.integers(5, 70),
    ops=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 3), st.booleans()), min_size=50, max_size=400),
)
def test_a_table_that_grows_and_evicts_keeps_finding_its_leaders(max_leaders, ops):
    # Room for the first few leaders, doubled as more come, then the oldest evicted: through
    # all of it every key is found where it is (the hash index moves entries as keys leave).
    t = _table(leader_len=2, follower_len=1, max_leaders=max_leaders, max_followers=2)
    _check_against_model(t, ops, 2)


def test_leaders_and_followers_of_the_wrong_shape_are_refused():
    t = _table(leader_len=2, follower_len=3)
    with pytest.raises(ValueError, match="leader has 2 tokens"):
        t.add((1,), (2,))
    with pytest.raises(ValueError, match="at least one token"):
        t.add((1, 2), ())
    with pytest.raises(ValueError, match="token ids"):
        t.add((1, 2), (-1,))
    t.add((1, 2), (3, 4, 5, 6, 7))  # a longer follower is cut, as recorded branches are
    assert t.followers((1, 2)) == [((3, 4, 5), 1)]
    assert len(t) == 1 and t.version == 1


# -- RejectedCache ---------------------------------------------------------------------------


def test_rejected_records_under_context_tail():
    cache = RejectedCache(LruTableConfig(leader_len=2, follower_len=3))
    cache.record(_a([1, 5, 6]), _a([9, 8, 7, 6]))
    # Keyed by the last two context tokens; the branch is cut to follower_len.
    assert cache.table.followers((5, 6)) == [((9, 8, 7), 1)]


def test_rejected_ignores_short_context_and_empty_branch():
    cache = RejectedCache(LruTableConfig(leader_len=2, follower_len=3))
    cache.record(_a([6]), _a([9]))
    cache.record(_a([5, 6]), _a([]))
    # Neither call has both a full leader and a non-empty branch.
    assert len(cache.table) == 0


def test_followers_recorded_at_one_place_match_branches_recorded_one_by_one():
    config = LruTableConfig(leader_len=2, follower_len=3, max_followers=2)
    tokens = _a([4, 5, 6, 7, 8])
    by_branch, by_place = RejectedCache(config), RejectedCache(config)
    branches = [_a([9, 8, 7]), _a([3]), _a([9, 8, 7])]
    by_branch.record_at(tokens, [(3, b) for b in branches])
    by_place.record_followers(tokens, 3, [tuple(b.tolist()) for b in branches])
    assert by_place.table.items() == by_branch.table.items() == [((5, 6), [((3,), 1), ((9, 8, 7), 2)])]
    by_place.record_followers(tokens, 1, [(1, 2)])  # no full leader before it: nothing kept
    by_place.record_followers(tokens, 4, [()])  # an empty branch: nothing kept
    assert by_place.table.items() == by_branch.table.items()

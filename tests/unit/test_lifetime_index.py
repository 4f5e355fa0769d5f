import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.lifetime_index import LifetimeConfig, LifetimeMemory, build_indexes, next_indexes, prompt_key
from indexer.ngram_table import NgramTableConfig
from indexer.tokens import SEPARATOR

S = int(SEPARATOR)


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _mem(**kw):
    return LifetimeMemory(LifetimeConfig(**kw))


def _occurrences(mem, pattern):
    """Occurrences of ``pattern`` summed over every index the drafter searches."""
    total = 0
    for idx in mem.suffix_indexes():
        n, first, last = idx.longest_match(_a(pattern), max_len=len(pattern), min_len=len(pattern))
        total += last - first if n else 0
    return total


@pytest.mark.parametrize(
    "kw",
    [
        {"capacity_tokens": 1},
        {"capacity_tokens": 2**31},  # past int32 positions
        {"delta_max_tokens": 0},
        {"exact_entries": -1},
        {"exact_max_tokens": -1},
        {"table_refresh": -0.1},
        {"table_refresh": 1.5},
    ],
)
def test_config_validation(kw):
    # Sizes outside their documented ranges are rejected.
    with pytest.raises(ValueError):
        LifetimeConfig(**kw)


def test_capacity_up_to_int32_positions_is_taken():
    # The largest ring whose positions a suffix array's int32 entries still hold.
    assert LifetimeConfig(capacity_tokens=2**31 - 1).capacity_tokens == 2**31 - 1


def test_prompt_key_depends_on_every_token():
    # Same ids, same key; one different id, different key.
    assert prompt_key(_a([1, 2, 3])) == prompt_key(_a([1, 2, 3]))
    assert prompt_key(_a([1, 2, 3])) != prompt_key(_a([1, 2, 4]))
    # A 16-byte digest.
    assert len(prompt_key(_a([1]))) == 16


def test_commit_is_searchable_before_any_rebuild():
    mem = _mem(capacity_tokens=64)
    mem.commit(_a([1, 2, 3, 4]))
    # Only the delta index exists yet, and it holds the request.
    assert mem.indexes is None
    assert len(mem.suffix_indexes()) == 1
    assert _occurrences(mem, [2, 3]) == 1
    # Matches never run across the separator into the next request.
    mem.commit(_a([5, 6]))
    assert _occurrences(mem, [4, 5]) == 0


def test_rebuild_moves_delta_into_main_index():
    mem = _mem(capacity_tokens=64)
    mem.commit(_a([1, 2, 3]))
    mem.commit(_a([2, 3, 4]))
    built = mem.rebuild()
    # The rebuilt index covers the buffer up to its current version; the delta is now empty.
    assert built.version == mem.buffer.appended == 8
    assert mem.indexes is built
    assert len(mem.suffix_indexes()) == 1
    assert mem.delta_tokens() == 0
    # Each occurrence is found exactly once.
    assert _occurrences(mem, [2, 3]) == 2
    mem.commit(_a([2, 3, 9]))
    # New requests land in a fresh delta beside the main index.
    assert len(mem.suffix_indexes()) == 2
    assert _occurrences(mem, [2, 3]) == 3


def test_rebuild_builds_ngram_table():
    mem = _mem(capacity_tokens=64, table=NgramTableConfig(leader_len=2, follower_len=2, min_count=2))
    for _ in range(2):
        mem.commit(_a([1, 2, 3, 4]))
    mem.rebuild()
    rows, _, count = mem.indexes.table.lookup(_a([1, 2]))
    # "1 2" was followed by "3 4" in both requests.
    assert rows.tolist() == [[3, 4]]
    assert count == 2


def test_needs_rebuild_after_delta_max_tokens():
    mem = _mem(capacity_tokens=64, delta_max_tokens=5)
    mem.commit(_a([1, 2, 3]))
    # 3 tokens + separator = 4 <= 5: not yet.
    assert mem.delta_tokens() == 4
    assert not mem.needs_rebuild()
    mem.commit(_a([4]))
    # 6 > 5: a rebuild is due.
    assert mem.needs_rebuild()
    mem.rebuild()
    assert not mem.needs_rebuild()


def test_commit_many_equals_individual_commits():
    one, many = _mem(capacity_tokens=32), _mem(capacity_tokens=32)
    reqs = [_a([1, 2]), _a([3, 1, 2]), _a([2, 5])]
    for r in reqs:
        one.commit(r)
    many.commit_many(reqs)
    # Same buffer and the same matches either way.
    assert one.buffer.snapshot().tolist() == many.buffer.snapshot().tolist()
    assert _occurrences(one, [1, 2]) == _occurrences(many, [1, 2]) == 2


def test_exact_prompt_cache():
    mem = _mem(capacity_tokens=64)
    mem.commit(_a([1, 2, 7, 8]), prompt=_a([1, 2]), response=_a([7, 8]))
    # The prompt's key returns the response that followed it.
    assert mem.exact_response(prompt_key(_a([1, 2]))).tolist() == [7, 8]
    # Another prompt has no entry.
    assert mem.exact_response(prompt_key(_a([1, 3]))) is None


def test_exact_cache_evicts_least_recent_and_truncates():
    mem = _mem(capacity_tokens=64, exact_entries=2, exact_max_tokens=3)
    for p in (1, 2, 3):
        mem.commit(_a([p]), prompt=_a([p]), response=_a([p, p, p, p, p]))
    # Two entries at most: the first prompt was evicted.
    assert mem.exact_response(prompt_key(_a([1]))) is None
    # Responses are cut to exact_max_tokens.
    assert mem.exact_response(prompt_key(_a([3]))).tolist() == [3, 3, 3]


def test_exact_cache_disabled_or_empty_response():
    off = _mem(capacity_tokens=64, exact_entries=0)
    off.commit(_a([1]), prompt=_a([1]), response=_a([2]))
    # exact_entries=0 turns the cache off.
    assert off.exact_response(prompt_key(_a([1]))) is None
    on = _mem(capacity_tokens=64)
    on.commit(_a([1]), prompt=_a([1]), response=_a([]))
    # An empty response is not worth remembering.
    assert on.exact_response(prompt_key(_a([1]))) is None


def test_build_indexes_is_pure():
    tokens = _a([1, 2, 3, S, 1, 2, 4, S])
    built = build_indexes(tokens, NgramTableConfig(leader_len=1, follower_len=1), version=7)
    # The version is recorded as given; the input is untouched.
    assert built.version == 7
    assert tokens.tolist() == [1, 2, 3, S, 1, 2, 4, S]
    # The suffix index answers over the snapshot.
    assert built.suffix.longest_match(_a([9, 1, 2]), max_len=4)[0] == 2
    assert built.nbytes > 0


def test_rebuild_after_oversized_request_clears_delta():
    mem = _mem(capacity_tokens=8)
    mem.commit(np.arange(20, dtype=np.int32))
    mem.rebuild()
    # The ring holds 13..19 and a separator; after the rebuild only the main index covers it.
    assert len(mem.suffix_indexes()) == 1
    # "15 16" occurs once in the buffer, so once across all indexes.
    assert _occurrences(mem, [15, 16]) == 1


@settings(max_examples=50, deadline=None)
@given(
    capacity=st.integers(6, 30),
    # Requests shorter than the ring (the oversized case is tested above).
    steps=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=4), st.booleans()), min_size=1, max_size=8),
)
def test_indexes_cover_buffer_exactly_after_rebuild(capacity, steps):
    mem = _mem(capacity_tokens=capacity, table=NgramTableConfig(leader_len=1, follower_len=1))
    for req, rebuild in steps:
        mem.commit(_a(req))
        if rebuild:
            mem.rebuild()
    mem.rebuild()
    snap = mem.buffer.snapshot().tolist()
    for pattern in ([0], [1], [0, 1], [2, 2], [3, 0, 1]):
        want = sum(snap[i : i + len(pattern)] == pattern for i in range(len(snap)))
        # Right after a rebuild, the searched indexes hold exactly the buffer: no token missing,
        # none counted twice.
        assert _occurrences(mem, pattern) == want


def test_delta_runs_stay_logarithmic():
    # 64 requests of 3 tokens (+ separator): runs double going back, so at most log2(64) + 1.
    mem = _mem(capacity_tokens=4096)
    for i in range(64):
        mem.commit(_a([i % 7, i % 5, i % 3]))
    runs = mem.suffix_indexes()
    assert 1 <= len(runs) <= 7
    assert sum(r.size for r in runs) == 64 * 4
    # Every pair is found exactly as often as it occurs (no request lost, none indexed twice).
    text = [t for i in range(64) for t in (i % 7, i % 5, i % 3, -1)]
    for pair in ([6, 4], [0, 0], [1, 1]):
        expected = sum(1 for j in range(len(text) - 1) if text[j : j + 2] == pair)
        assert expected >= 1 and _occurrences(mem, pair) == expected


def _brute_longest_prefix(requests, tokens):
    """Longest n with tokens[:n] inside one committed request (requests never span each other)."""
    best = 0
    for req in requests:
        for n in range(len(tokens), best, -1):
            if any(req[i : i + n] == tokens[:n] for i in range(len(req) - n + 1)):
                best = n
                break
    return best


def _brute_known_prefix(requests, tokens, min_piece):
    """Followed from piece to piece while each continues for min_piece tokens (or to the end)."""
    pos = 0
    while pos < len(tokens):
        n = _brute_longest_prefix(requests, tokens[pos:])
        if n < min(min_piece, len(tokens) - pos):
            break
        pos += n
    return pos


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
    tokens=st.lists(st.integers(0, 3), max_size=16),
    rebuild_after=st.integers(0, 6),
)
def test_known_prefix_matches_brute_force(requests, tokens, rebuild_after):
    mem = _mem(capacity_tokens=4096)
    for i, req in enumerate(requests):
        mem.commit(_a(req))
        if i + 1 == rebuild_after:
            mem.rebuild()
    for min_piece in (1, 3):
        assert mem.known_prefix(_a(tokens), min_piece) == _brute_known_prefix(requests, tokens, min_piece)


def _continuations_one_by_one(mem, ctx, max_len, depth, samples):
    """Reference: each index searched on its own (later ones only for matches at least as
    long), the samples shared by the indexes holding the longest match, by their counts."""
    best, hits = 0, []
    for index in mem.suffix_indexes():
        n, first, last = index.longest_match(ctx, max_len, min_len=max(best, 1))
        if n > best:
            best, hits = n, []
        if n and n == best:
            hits.append((index, first, last))
    if not hits:
        return 0, np.zeros((0, depth), dtype=np.int32), np.zeros(0)
    total = sum(last - first for _, first, last in hits)
    parts = [idx.continuations(f, la, best, depth, -(-samples * (la - f) // total)) for idx, f, la in hits]
    return best, np.vstack([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=12),
    rebuild_after=st.integers(0, 12),
    ctx=st.lists(st.integers(0, 4), min_size=1, max_size=12),
    samples=st.integers(1, 6),
    depth=st.integers(1, 5),
    hint=st.integers(0, 12),
)
def test_continuations_over_all_indexes_match_searching_each(requests, rebuild_after, ctx, samples, depth, hint):
    # One compiled search over the main index and the delta runs gives what searching each
    # index in turn gives: the same match length, rows and weights, in index order.
    mem = _mem(capacity_tokens=1 << 12)
    for i, r in enumerate(requests):
        mem.commit(_a(r))  # each commit a run of its own; runs merge as they double
        if i + 1 == rebuild_after:
            mem.rebuild()
    c = _a(ctx)
    n, rows, weights = mem.continuations(c, max_len=8, depth=depth, samples=samples, hint=hint)
    ref_n, ref_rows, ref_weights = _continuations_one_by_one(mem, c, 8, depth, samples)
    assert n == ref_n
    assert rows.tolist() == ref_rows.tolist()
    assert weights.tolist() == pytest.approx(ref_weights.tolist())
    # Every row continues an occurrence the match really has: its weight counts occurrences.
    assert (weights > 0).all() and rows.shape == (weights.size, depth)


def test_indexes_holding_the_match_share_the_samples_by_count():
    # "1 2" occurs 3 times in the main index and 3 times in the delta: 2 samples are shared
    # one each, and each row stands for the 3 occurrences of its index.
    mem = _mem(capacity_tokens=256)
    mem.commit_many([_a([1, 2, 3])] * 3)
    mem.rebuild()
    mem.commit_many([_a([1, 2, 4])] * 3)
    n, rows, weights = mem.continuations(_a([1, 2]), max_len=8, depth=2, samples=2)
    assert n == 2
    assert rows.tolist() == [[3, -1], [4, -1]]
    assert weights.tolist() == [3.0, 3.0]
    # A longer match in one index only: that index alone answers.
    mem.commit(_a([0, 1, 2, 5]))
    n, rows, weights = mem.continuations(_a([0, 1, 2]), max_len=8, depth=1, samples=4)
    assert (n, rows.tolist(), weights.tolist()) == (3, [[5]], [1.0])


SMALL_TABLE = NgramTableConfig(leader_len=1, follower_len=2, min_count=1)


def _same_arrays(a, b):
    return all(x.tolist() == b.table.arrays()[k].tolist() for k, x in a.table.arrays().items())


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.lists(st.lists(st.integers(0, 5), max_size=9), min_size=1, max_size=4), min_size=1, max_size=8),
    capacity=st.integers(2, 48),
)
def test_rebuilds_extend_the_last_generation_and_equal_a_fresh_build(batches, capacity):
    """Whatever the ring overwrote between rebuilds (nothing, a head cut mid-request, all of
    it), a rebuild gives the suffix array a fresh sort of the buffer gives; it extends the last
    generation whenever part of it is still held. With table_refresh 0 the table is rebuilt each
    time and equals a fresh build's."""
    mem = _mem(capacity_tokens=capacity, table=SMALL_TABLE, table_refresh=0.0)
    previous = None
    for batch in batches:
        held_before = None if previous is None else mem.buffer.appended - previous.version
        for request in batch:
            mem.commit(_a(request))
        built = mem.rebuild()
        fresh = build_indexes(mem.buffer.snapshot(), SMALL_TABLE, mem.buffer.appended)
        assert built.suffix.suffix_array.tolist() == fresh.suffix.suffix_array.tolist()
        assert built.suffix.tokens.tolist() == fresh.suffix.tokens.tolist()
        assert _same_arrays(built, fresh)
        if previous is not None and previous.version > 0 and held_before is not None:
            # Extended exactly when some of the last generation's tokens are still in the ring.
            kept = built.suffix.size - (built.version - previous.version)
            assert built.extended == (kept > 0)
        previous = built


def test_the_table_is_carried_until_enough_is_new():
    config = LifetimeConfig(table=SMALL_TABLE, table_refresh=0.5)
    first = next_indexes(None, _a([1, 2, S, 1, 2, S]), 6, config, 6)
    assert (first.table_built_at, first.extended) == (6, False)
    # 3 new of 9 tokens: under half, so the table stays as it was ("1" is still followed by "2").
    second = next_indexes(first, _a([1, 2, S, 1, 2, S, 1, 3, S]), 3, config, 9)
    assert second.extended and second.table is first.table and second.table_built_at == 6
    assert second.table.lookup(_a([1]))[0].tolist() == [[2, -1]]
    # 6 of 12 tokens new since the table was built: rebuilt, and now it knows "1 3".
    third = next_indexes(second, _a([1, 2, S, 1, 2, S, 1, 3, S, 1, 3, S]), 3, config, 12)
    assert third.table_built_at == 12 and third.table is not first.table
    assert sorted(third.table.lookup(_a([1]))[0].tolist()) == [[2, -1], [3, -1]]


def test_a_generation_that_does_not_fit_is_sorted_afresh():
    config = LifetimeConfig(table=SMALL_TABLE)
    first = next_indexes(None, _a([1, 2, S]), 3, config, 3)
    # The kept part is not the last generation's tail: sorted afresh, still right.
    other = next_indexes(first, _a([7, 8, S, 4, S]), 2, config, 5)
    assert not other.extended
    fresh = build_indexes(_a([7, 8, S, 4, S]), SMALL_TABLE, 5)
    assert other.suffix.suffix_array.tolist() == fresh.suffix.suffix_array.tolist()
    # An array from an older release (separators sorted as tokens) is never extended.
    old = build_indexes(_a([1, 2, S]), SMALL_TABLE, 3)
    older = type(old)(old.suffix, old.table, old.version, old.build_seconds, extendable=False)
    assert not next_indexes(older, _a([1, 2, S, 4, S]), 2, config, 5).extended
    assert next_indexes(first, _a([1, 2, S, 4, S]), 2, config, 5).extended


def test_a_rebuild_with_nothing_new_keeps_the_last_generation():
    mem = _mem(capacity_tokens=64)
    mem.commit(_a([1, 2, 3]))
    first = mem.rebuild()
    # Nothing committed since: the same generation, not the whole buffer sorted afresh (and its
    # serial unchanged, so the matches sessions carry from it stay usable).
    assert mem.rebuild() is first
    mem.commit(_a([2, 3, 4]))
    second = mem.rebuild()
    assert second is not first and second.extended
    # Two callers at once: one builds, the other waits and gets what it built.
    mem.commit(_a([3, 4, 5]))
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: mem.rebuild(), range(2)))
    assert built[0] is built[1] is mem.indexes
    assert built[0] is not second and built[0].extended


def test_searches_beside_a_rebuild_count_each_request_once():
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often, so searches land inside the swap
    try:
        for _ in range(3):
            mem = _mem(capacity_tokens=1 << 17)
            mem.commit_many([_a([1, 2, 3])] * 20000)
            seen: set[tuple[int, int]] = set()
            searching, done = threading.Event(), threading.Event()

            def search(mem=mem, seen=seen, searching=searching, done=done):
                while not done.is_set():
                    n, _, weights = mem.continuations(_a([1, 2]), max_len=4, depth=1, samples=4)
                    seen.add((n, round(float(weights.sum()))))
                    searching.set()

            reader = threading.Thread(target=search)
            reader.start()
            searching.wait()
            mem.rebuild()
            done.set()
            reader.join()
            # Before, during and after the rebuild a search finds "1 2" 20000 times: in the
            # delta, then in the main index, never in both at once nor in neither.
            assert seen == {(2, 20000)}
    finally:
        sys.setswitchinterval(switch)


@pytest.mark.parametrize("capacity", [2, 3, 7, 60])
def test_searches_beside_commits_and_rebuilds_find_only_requests_as_committed(capacity):
    # A rebuild thread swaps generations in while requests are committed (the ring wrapping
    # many times over) and searched: every match and continuation found is a stretch of one
    # request as the memory keeps it, never text joined across requests or a wrap seam.
    rng = np.random.default_rng(capacity)
    mem = _mem(capacity_tokens=capacity, delta_max_tokens=5, table_refresh=0.0)
    kept: list[list[int]] = []
    done = threading.Event()

    def rebuild():
        while not done.is_set():
            mem.rebuild()

    rebuilder = threading.Thread(target=rebuild)
    rebuilder.start()
    try:
        for _ in range(400):
            request = rng.integers(0, 3, int(rng.integers(0, 12))).astype(np.int32)
            mem.commit(request)
            kept.append(request[-(capacity - 1) :].tolist() if request.size >= capacity else request.tolist())
            ctx = rng.integers(0, 3, int(rng.integers(0, 6))).astype(np.int32)
            n, rows, _ = mem.continuations(ctx, max_len=8, depth=4, samples=4)
            for row in rows.tolist():
                tail = [t for t in row if t >= 0]
                assert row == tail + [-1] * (len(row) - len(tail))  # padding only after the end
                piece = ctx[ctx.size - n :].tolist() + tail
                assert any(r[i : i + len(piece)] == piece for r in kept for i in range(len(r) - len(piece) + 1))
    finally:
        done.set()
        rebuilder.join()
    # Once the last commit is rebuilt, one index holds exactly the ring.
    mem.rebuild()
    assert [i.tokens.tolist() for i in mem.suffix_indexes()] == [mem.buffer.snapshot().tolist()]

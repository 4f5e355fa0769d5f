import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.context_index import ContextIndex

# Prompts longer than 256 tokens are suffix-array indexed; shorter ones are scanned. Every
# literal case runs against both by prefixing it with distinct filler tokens.
SHORT, LONG = 20, 300


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _filler(n):
    # Distinct ids that never occur in the literal cases (< 1000), so they cannot create matches.
    return list(range(1000, 1000 + n))


def _lookup(ctx, *, max_len=8, depth=3, samples=64, hint=0):
    n, rows, weights = ctx.lookup(max_len=max_len, depth=depth, samples=samples, hint=hint)
    return n, sorted(rows.tolist()), weights


def test_doctest_case():
    ctx = ContextIndex(_a([4, 5, 6, 7, 4, 5]))
    n, rows, weights = _lookup(ctx)
    # "4 5" occurred before, followed by "6 7 4".
    assert (n, rows) == (2, [[6, 7, 4]])
    # One occurrence, weight one.
    assert weights.tolist() == [1.0]


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_no_trivial_self_match(size):
    ctx = ContextIndex(_a(_filler(size)))
    n, rows, weights = _lookup(ctx)
    # Every token is distinct: the context's suffix only occurs as itself, which never counts.
    assert n == 0
    assert rows == [] and weights.size == 0


def test_single_token_context_has_no_match():
    # One token can only match itself.
    assert ContextIndex(_a([5])).lookup(max_len=4, depth=2, samples=4)[0] == 0


# Regression: at a46d8c2 an empty context raised IndexError (ctx[-1] in _tail_matches).
def test_empty_context_has_no_match():
    n, rows, _ = ContextIndex(_a([])).lookup(max_len=4, depth=2, samples=4)
    # Nothing to match in an empty context.
    assert n == 0
    assert rows.shape == (0, 2)


def test_max_len_zero_means_no_match():
    n, rows, _ = ContextIndex(_a([1, 2, 1])).lookup(max_len=0, depth=2, samples=4)
    # A match may be at most 0 tokens long: none.
    assert n == 0
    assert rows.shape == (0, 2)


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_longest_earlier_occurrence_wins(size):
    # "1 2 3" then "9 2 3" earlier; the context ends with "1 2 3" (n = 3, not "2 3").
    ctx = ContextIndex(_a([*_filler(size), 1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]))
    n, rows, _ = _lookup(ctx)
    assert n == 3
    # Only the occurrence of the full "1 2 3" contributes: it was followed by "4 9 2".
    assert rows == [[4, 9, 2]]


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_all_occurrences_contribute(size):
    ctx = ContextIndex(_a([*_filler(size), 7, 1, 7, 2, 7, 3, 7]))
    n, rows, weights = _lookup(ctx, depth=1)
    # "7" occurred three times before the end, followed by 1, 2 and 3.
    assert n == 1
    assert rows == [[1], [2], [3]]
    assert weights.sum() == pytest.approx(3)


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_max_len_caps_match(size):
    ctx = ContextIndex(_a([*_filler(size), 1, 2, 3, 4, 1, 2, 3]))
    # The full match is "1 2 3" but max_len allows only 2.
    assert _lookup(ctx, max_len=2)[0] == 2


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_rows_padded_at_end_of_context(size):
    ctx = ContextIndex(_a([*_filler(size), 1, 2, 1]))
    n, rows, _ = _lookup(ctx, depth=4)
    # "1" occurred once, followed by "2 1" and then the end of the context.
    assert (n, rows) == (1, [[2, 1, -1, -1]])


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_extension_repeating_the_prompt(size):
    ctx = ContextIndex(_a([*_filler(size), 10, 11, 12, 13, 14]))
    ctx.extend(_a([10, 11]))
    n, rows, _ = _lookup(ctx)
    # The generated "10 11" repeats the prompt, where "12 13 14" followed.
    assert (n, rows) == (2, [[12, 13, 14]])
    # extend grows the context.
    assert len(ctx) == size + 7
    assert ctx.tokens[-2:].tolist() == [10, 11]


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_suffix_spanning_boundary_matches_prompt(size):
    ctx = ContextIndex(_a([*_filler(size), 50, 51, 52, 53, 54, 9, 50, 51]))
    ctx.extend(_a([52]))
    n, rows, _ = _lookup(ctx)
    # The context's suffix "50 51 52" starts in the prompt and ends in the extension.
    assert (n, rows) == (3, [[53, 54, 9]])


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_earlier_occurrence_spanning_boundary(size):
    ctx = ContextIndex(_a([*_filler(size), 60, 61]))
    ctx.extend(_a([62, 5, 60, 61, 62]))
    n, rows, _ = _lookup(ctx, depth=5)
    # "60 61 62" occurred across the prompt/extension boundary, followed by "5 60 61 62" and the end.
    assert (n, rows) == (3, [[5, 60, 61, 62, -1]])


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_occurrences_in_prompt_and_extension_both_count(size):
    ctx = ContextIndex(_a([*_filler(size), 8, 1]))
    ctx.extend(_a([8, 2, 8]))
    n, rows, weights = _lookup(ctx, depth=1)
    # "8" was seen in the prompt (then 1) and in the extension (then 2).
    assert (n, rows) == (1, [[1], [2]])
    assert weights.sum() == pytest.approx(2)


def test_many_extensions_grow_buffer():
    ctx = ContextIndex(_a([1, 2, 3]))
    for i in range(100):
        ctx.extend(_a([4 + i % 3]))
    # 3 + 100 tokens, in order, across buffer growths.
    assert len(ctx) == 103
    assert ctx.tokens[:6].tolist() == [1, 2, 3, 4, 5, 6]
    assert ctx.tokens[-1] == 4 + 99 % 3


def test_samples_bound_rows_from_tail():
    ctx = ContextIndex(_a([5, 1, 5, 2, 5, 3, 5]))
    n, rows, _ = ctx.lookup(max_len=4, depth=1, samples=1)
    # Three earlier "5"s but one sample: the most recent one (followed by 3) is used.
    assert (n, rows.tolist()) == (1, [[3]])


def test_samples_bound_rows_from_index():
    prompt = [*_filler(LONG), *([5, 1] * 40), 5]
    n, rows, weights = ContextIndex(_a(prompt)).lookup(max_len=1, depth=1, samples=4)
    # 40 earlier "5"s, 4 samples: each stands for 10 occurrences.
    assert n == 1
    assert rows.tolist() == [[1]] * 4
    assert weights.sum() == pytest.approx(40)


# -- property tests --------------------------------------------------------------------------


def _brute(ctx, max_len, depth):
    """(n, rows): longest suffix (<= max_len) occurring earlier, ending before the last token."""
    size = len(ctx)
    best, ends = 0, []
    for n in range(1, min(max_len, size - 1) + 1):
        pat = ctx[size - n :]
        found = [s + n - 1 for s in range(size - n) if ctx[s : s + n] == pat]
        if not found:
            break
        best, ends = n, found
    rows = [(ctx[e + 1 : e + 1 + depth] + [-1] * depth)[:depth] for e in ends]
    return best, sorted(rows)


def _check(prompt, ext, max_len, depth, hint):
    ctx = ContextIndex(_a(prompt))
    if ext:
        ctx.extend(_a(ext))
    full = prompt + ext
    n, rows, weights = ctx.lookup(max_len=max_len, depth=depth, samples=10_000, hint=hint)
    want_n, want_rows = _brute(full, max_len, depth)
    # The longest earlier occurrence of the context's suffix, never the suffix itself.
    assert n == want_n
    # With enough samples every earlier occurrence contributes its continuation once.
    assert sorted(rows.tolist()) == want_rows
    assert weights.sum() == pytest.approx(len(want_rows))


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    ext=st.lists(st.integers(0, 3), max_size=10),
    max_len=st.integers(1, 10),
    depth=st.integers(1, 4),
    hint=st.integers(0, 12),
)
def test_short_prompt_matches_brute_force(prompt, ext, max_len, depth, hint):
    _check(prompt, ext, max_len, depth, hint)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=257, max_size=300),
    ext=st.lists(st.integers(0, 3), max_size=12),
    max_len=st.integers(1, 12),
    depth=st.integers(1, 4),
    hint=st.integers(0, 14),
)
def test_long_prompt_matches_brute_force(prompt, ext, max_len, depth, hint):
    _check(prompt, ext, max_len, depth, hint)


# -- followers (the dynamic tier) --------------------------------------------------------------


def _brute_followers(ids, ll, fl, keep, since):
    """Distinct followers of the last ``ll`` ids, most recent occurrence first, with counts."""
    n, order, counts = len(ids), [], {}
    for p in range(n - ll - fl, since - 1, -1):
        if ids[p : p + ll] == ids[n - ll :]:
            f = tuple(ids[p + ll : p + ll + fl])
            if f not in counts:
                order.append(f)
                counts[f] = 0
            counts[f] += 1
    return [list(f) for f in order[:keep]], [float(counts[f]) for f in order[:keep]]


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_followers_most_recent_first_with_counts(size):
    ctx = ContextIndex(_a([*_filler(size), 1, 2, 9, 1, 2, 8, 1, 2, 9]))
    ctx.extend(_a([1, 2]))
    rows, counts = ctx.followers(leader_len=2, follower_len=1, keep=4)
    # "1 2" was followed by 9 (twice, most recently) and by 8 (once).
    assert rows.tolist() == [[9], [8]] and counts.tolist() == [2.0, 1.0]
    # keep bounds the followers; the most recent stays.
    assert ctx.followers(leader_len=2, follower_len=1, keep=1)[0].tolist() == [[9]]


@pytest.mark.parametrize("size", [SHORT, LONG])
def test_followers_need_a_complete_follower_and_respect_since(size):
    ctx = ContextIndex(_a([*_filler(size), 1, 2, 7, 7, 1, 2, 5]))
    ctx.extend(_a([1, 2]))
    # Four tokens: after the second "1 2" only "5 1 2" remain, incomplete; the first has "7 7 1 2".
    rows, _ = ctx.followers(leader_len=2, follower_len=4, keep=4)
    assert rows.tolist() == [[7, 7, 1, 2]]
    # Occurrences starting before ``since`` are ignored.
    assert ctx.followers(leader_len=2, follower_len=1, keep=4, since=size + 3)[0].tolist() == [[5]]


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=0, max_size=400),
    ext=st.lists(st.integers(0, 3), max_size=30),
    ll=st.integers(1, 3),
    fl=st.integers(1, 4),
    keep=st.integers(1, 5),
    since=st.integers(0, 50),
)
def test_followers_match_brute_force(prompt, ext, ll, fl, keep, since):
    # Indexed prompts (> 256 tokens) and scanned ones agree with a direct scan.
    ctx = ContextIndex(_a(prompt))
    ctx.extend(_a(ext))
    rows, counts = ctx.followers(leader_len=ll, follower_len=fl, keep=keep, since=since)
    want_rows, want_counts = _brute_followers(prompt + ext, ll, fl, keep, since)
    assert rows.tolist() == want_rows and counts.tolist() == want_counts

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import kernels
from indexer.ngram_table import lcp_array
from indexer.suffix_array import SuffixIndex, build_suffix_array, extend_suffix_array
from indexer.tokens import SEPARATOR

S = int(SEPARATOR)

# Small alphabets make repeats (and hence ties deep into the suffixes) likely.
texts = st.lists(st.sampled_from([0, 1, 2, 3, S]), max_size=40)
contexts = st.lists(st.integers(0, 3), max_size=10)


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _key(t, i):
    """A suffix's sort key: its tokens up to and including the first separator (the whole rest
    when there is none), then its position: suffixes equal through a separator sort by place."""
    end = t.index(S, i) + 1 if S in t[i:] else len(t)
    return (t[i:end], i)


def _brute_sa(t):
    return sorted(range(len(t)), key=lambda i: _key(t, i))


def _occurrences(text, pattern):
    m = len(pattern)
    return [i for i in range(len(text) - m + 1) if text[i : i + m] == pattern]


def _brute_longest(text, ctx, max_len, min_len=1):
    """Longest n in [min_len, max_len] with ctx[-n:] occurring in text (0 if none)."""
    best = 0
    for n in range(min_len, min(max_len, len(ctx)) + 1):
        if _occurrences(text, ctx[-n:]):
            best = n
    return best


# -- construction --------------------------------------------------------------------------


def test_build_suffix_array_literal():
    # Suffixes of 3 1 2 1 2: "1 2" (3) < "1 2 1 2" (1) < "2" (4) < "2 1 2" (2) < "3 ..." (0).
    assert build_suffix_array(_a([3, 1, 2, 1, 2])).tolist() == [3, 1, 4, 2, 0]


def test_build_suffix_array_empty():
    out = build_suffix_array(_a([]))
    # No suffixes; still the int32 dtype lookups rely on.
    assert out.tolist() == []
    assert out.dtype == np.int32


def test_separator_sorts_after_every_id():
    # SEPARATOR is the largest int32, so "S ..." suffixes come last and "1 S" follows "1 2".
    assert build_suffix_array(_a([1, S, 1, 2])).tolist() == [2, 0, 3, 1]


def _prefix_doubling(tokens):
    """An independent reference: prefix doubling over numpy ranks, O(n log^2 n)."""
    n = tokens.size
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64) + 1
    seps = np.flatnonzero(tokens == S)  # each separator a symbol of its own, rising along the text
    rank[seps] = rank.max(initial=0) + 1 + np.arange(seps.size)
    k = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        second[: max(n - k, 0)] = rank[k:]
        order = np.lexsort((second, rank))
        key = np.stack((rank[order], second[order]))
        changed = np.ones(n, dtype=bool)
        changed[1:] = (key[:, 1:] != key[:, :-1]).any(axis=0)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(changed)
        if changed.all() or k >= n:
            return order
        k *= 2


def test_build_suffix_array_single_token():
    assert build_suffix_array(_a([7])).tolist() == [0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3, S]), min_size=1, max_size=40))
def test_prefix_doubling_reference_matches_brute_force(t):
    assert _prefix_doubling(_a(t)).tolist() == _brute_sa(t)


# Far-apart values take the sorting renumbering; ids under a separator take the counting one.
sparse = st.lists(st.sampled_from([-(2**31), -7, 0, 5, 2**31 - 2, S]), max_size=40)


@settings(max_examples=200, deadline=None)
@given(sparse)
def test_build_suffix_array_sparse_values(t):
    assert build_suffix_array(_a(t)).tolist() == _brute_sa(t)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(0, 3000),
    st.integers(1, 40),
    st.integers(0, 2**32 - 1),
)
def test_build_suffix_array_long_repetitive_texts(alphabet, size, copies, seed):
    # Long texts full of copied stretches: the induced sort recurses several levels deep.
    rng = np.random.default_rng(seed)
    text = rng.integers(0, alphabet, size).astype(np.int32)
    for _ in range(copies):
        if size < 2:
            break
        length = int(rng.integers(1, size))
        src, dst = rng.integers(0, size - length + 1, 2)
        text[dst : dst + length] = text[src : src + length].copy()
    text[rng.random(size) < 0.01] = S
    assert build_suffix_array(text).tolist() == _prefix_doubling(text).tolist()


def test_build_suffix_array_periodic_text():
    text = np.tile(_a([4, 2, 9]), 500)
    assert build_suffix_array(text).tolist() == _prefix_doubling(text).tolist()


@settings(max_examples=200, deadline=None)
@given(texts)
def test_lcp_array_matches_brute_force(t):
    text = _a(t)
    sa = build_suffix_array(text)
    lcp = lcp_array(text, sa)
    assert lcp.dtype == np.int32

    def common(i, j):  # up to, not including, a separator: each is a symbol of its own
        k = 0
        while i + k < len(t) and j + k < len(t) and t[i + k] == t[j + k] and t[i + k] != S:
            k += 1
        return k

    assert lcp.tolist() == [0 if r == 0 else common(int(sa[r - 1]), int(sa[r])) for r in range(len(t))]


def test_separators_sort_by_place_and_nothing_after_one_decides():
    # "1 S 2" (0) and "1 S 0" (3) are equal through their separators: by place, though "0" < "2".
    # Plain lexicographic order would put 3 first.
    sa = build_suffix_array(_a([1, S, 2, 1, S, 0, S])).tolist()
    assert sa.index(0) < sa.index(3)
    assert sa == _brute_sa([1, S, 2, 1, S, 0, S])


# Request-shaped texts: pieces of small ids, each ending with a separator.
requests = st.lists(st.lists(st.sampled_from([0, 1, 2, 3]), max_size=8), min_size=1, max_size=8)


def _joined(reqs):
    return [t for r in reqs for t in [*r, S]]


@settings(max_examples=300, deadline=None)
@given(old=requests, new=requests, data=st.data())
def test_extending_equals_building_afresh(old, new, data):
    """Dropping any head of the older text (even mid-request) and appending requests gives the
    array a fresh build of the result gives."""
    old_text, new_text = _joined(old), _joined(new)
    dropped = data.draw(st.integers(0, len(old_text)))
    text = old_text[dropped:] + new_text
    got = extend_suffix_array(_a(text), build_suffix_array(_a(old_text)), dropped, len(new_text))
    assert got.tolist() == build_suffix_array(_a(text)).tolist() == _brute_sa(text)


def test_extending_refuses_parts_that_do_not_fit():
    old = _a([1, 2, S])
    sa = build_suffix_array(old)
    with pytest.raises(ValueError, match="cannot make"):
        extend_suffix_array(_a([2, S, 3, S]), sa, 0, 2)  # kept 3 old tokens + 2 new != 4
    with pytest.raises(ValueError, match="each end with a separator"):
        extend_suffix_array(_a([1, 2, S, 3]), sa, 0, 1)
    with pytest.raises(ValueError, match="cannot make"):
        extend_suffix_array(_a([1, 2, S]), sa, 0, 0)  # nothing new


def _plain_sa(t):
    """Plain lexicographic order, reading on past separators (how arrays were once sorted)."""
    return sorted(range(len(t)), key=lambda i: t[i:])


@settings(max_examples=200, deadline=None)
@given(text=requests, pattern=st.lists(st.integers(0, 3), min_size=1, max_size=5), depth=st.integers(1, 6))
def test_searches_see_no_difference_from_plain_order(text, pattern, depth):
    """Ranking separators apart changes no search: a pattern's rows are the same set and the
    rows read off them (cut at a separator) are the same, row for row, so drafts are too."""
    t = _joined(text)
    ours, plain = build_suffix_array(_a(t)), _a(_plain_sa(t))
    tokens = _a(t)
    p = _a(pattern)
    first, last = kernels.match_range(tokens, ours, p, 0, len(t))
    assert (first, last) == kernels.match_range(tokens, plain, p, 0, len(t))
    assert sorted(ours[first:last].tolist()) == sorted(plain[first:last].tolist())
    for samples in (1, 2, 3, 64):
        got = kernels.sample_rows(tokens, ours, first, last, len(pattern), depth, samples, S)
        assert got.tolist() == kernels.sample_rows(tokens, plain, first, last, len(pattern), depth, samples, S).tolist()


# -- SuffixIndex ---------------------------------------------------------------------------


def test_suffix_index_rejects_mismatched_suffix_array():
    t = _a([1, 2, 3, S])
    # One entry per token is required.
    with pytest.raises(ValueError, match="suffix array"):
        SuffixIndex(t, np.array([0, 1], dtype=np.int32))
    # And it must be int32.
    with pytest.raises(ValueError, match="suffix array"):
        SuffixIndex(t, build_suffix_array(t).astype(np.int64))


def test_suffix_index_accepts_precomputed_suffix_array():
    t = _a([5, 6, 7, 9, 5, 6, 8, S])
    idx = SuffixIndex(t, build_suffix_array(t))
    # Same answer as the doctest, which builds its own array.
    n, first, last = idx.longest_match(_a([1, 5, 6]), max_len=8)
    assert n == 2
    assert sorted(idx.suffix_array[first:last].tolist()) == [0, 4]
    # At least 8 tokens x (4 bytes + 4 bytes of suffix array).
    assert idx.nbytes >= 64
    assert idx.tokens.tolist() == [5, 6, 7, 9, 5, 6, 8, S]


def test_longest_match_literal():
    idx = SuffixIndex(_a([5, 6, 7, 9, 5, 6, 8]))
    n, first, last = idx.longest_match(_a([1, 5, 6]), max_len=8)
    # "1 5 6" never occurs but "5 6" does, twice (positions 0 and 4).
    assert n == 2
    assert sorted(idx.suffix_array[first:last].tolist()) == [0, 4]


def test_longest_match_respects_max_len():
    idx = SuffixIndex(_a([1, 2, 3, 4]))
    # "2 3 4" occurs, but max_len caps the reported match at 2 ("3 4").
    assert idx.longest_match(_a([2, 3, 4]), max_len=2)[0] == 2


def test_longest_match_does_not_cross_separator():
    idx = SuffixIndex(_a([1, 2, S, 3, 4]))
    # "2 3" would exist only across the separator, so only "3" matches.
    assert idx.longest_match(_a([2, 3]), max_len=4)[0] == 1


def test_longest_match_none_and_empty_index():
    # Token 9 never occurs: no match at all.
    assert SuffixIndex(_a([1, 2])).longest_match(_a([9]), max_len=4) == (0, 0, 0)
    # An empty index matches nothing.
    assert SuffixIndex(_a([])).longest_match(_a([1]), max_len=4) == (0, 0, 0)
    # max_len 0 asks for nothing.
    assert SuffixIndex(_a([1])).longest_match(_a([1]), max_len=0) == (0, 0, 0)


def test_longest_match_min_len():
    idx = SuffixIndex(_a([1, 2, 3]))
    # Only "3" matches the context "9 3"; with min_len 2 that is not enough.
    assert idx.longest_match(_a([9, 3]), max_len=4, min_len=2) == (0, 0, 0)


def _range(idx, pattern):
    """SA rows starting with exactly ``pattern``: a match of fixed length len(pattern)."""
    n, first, last = idx.longest_match(_a(pattern), max_len=len(pattern), min_len=len(pattern))
    return (first, last) if n else (first, first)


def test_fixed_length_match_range_literal():
    idx = SuffixIndex(_a([5, 6, 7, 9, 5, 6, 8]))
    first, last = _range(idx, [5, 6])
    # Two rows start with "5 6".
    assert last - first == 2
    # "6 9" never occurs: min_len = max_len = 2 finds nothing.
    assert idx.longest_match(_a([6, 9]), max_len=2, min_len=2)[0] == 0


@settings(max_examples=200, deadline=None)
@given(text=texts, ctx=contexts, max_len=st.integers(0, 12), min_len=st.integers(1, 4), hint=st.integers(0, 14))
def test_longest_match_matches_brute_force(text, ctx, max_len, min_len, hint):
    idx = SuffixIndex(_a(text))
    n, first, last = idx.longest_match(_a(ctx), max_len=max_len, min_len=min_len, hint=hint)
    # The longest context suffix (from min_len up to max_len) occurring contiguously in the text;
    # a pattern of real ids can never span a separator.
    assert n == _brute_longest(text, ctx, max_len, min_len)
    if n:
        occ = _occurrences(text, ctx[-n:])
        # The SA rows are exactly the occurrences of the matched suffix.
        assert last - first == len(occ)
        assert sorted(idx.suffix_array[first:last].tolist()) == occ
    else:
        assert (first, last) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(text=texts, data=st.data())
def test_longest_match_from_min_len_finds_longer_matches(text, data):
    # Contexts ending in a stretch of the text itself, so matches longer than min_len are common.
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, len(text)))
    ctx = [*data.draw(contexts), *(t for t in text[start:end] if t != S)]
    min_len, hint = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 14))
    n, _, _ = SuffixIndex(_a(text)).longest_match(_a(ctx), max_len=12, min_len=min_len, hint=hint)
    assert n == _brute_longest(text, ctx, 12, min_len)


def test_longest_match_goes_past_min_len():
    idx = SuffixIndex(_a([1, 2, 3, 4, 9, 2, 3, 4]))
    # "2 3 4" occurs twice, "1 2 3 4" once: asked for at least 2 tokens, the answer is all 4.
    assert idx.longest_match(_a([1, 2, 3, 4]), max_len=8, min_len=2)[:2] == (4, 0)


# Longer texts over ids of very different magnitudes (the search packs several ids into one
# integer key whose width depends on the largest id), with context ids that may be absent or
# larger than anything indexed.
WIDE = [0, 5, 255, 256, 65535, 2**31 - 2]
wide_texts = st.lists(st.sampled_from([*WIDE[:3], S]), min_size=0, max_size=150) | st.lists(
    st.sampled_from([*WIDE, S]), min_size=0, max_size=150
)
wide_contexts = st.lists(st.sampled_from([*WIDE, 1, 70000]), max_size=8)


@settings(max_examples=100, deadline=None)
@given(text=wide_texts, ctx=wide_contexts, max_len=st.integers(1, 8))
def test_longest_match_matches_brute_force_wide_ids(text, ctx, max_len):
    idx = SuffixIndex(_a(text))
    n, first, last = idx.longest_match(_a(ctx), max_len=max_len)
    # Same definition as above: the answer never depends on how large the ids are.
    assert n == _brute_longest(text, ctx, max_len)
    if n:
        assert sorted(idx.suffix_array[first:last].tolist()) == _occurrences(text, ctx[-n:])


@settings(max_examples=100, deadline=None)
@given(text=texts, ctx=contexts, max_len=st.integers(0, 12), data=st.data())
def test_hint_never_changes_the_result(text, ctx, max_len, data):
    idx = SuffixIndex(_a(text))
    hint = data.draw(st.integers(0, max_len + 2))
    min_len = data.draw(st.integers(1, 3))
    # The hint only orders the probes; the answer is the same as without one.
    assert idx.longest_match(_a(ctx), max_len, min_len=min_len, hint=hint) == idx.longest_match(
        _a(ctx), max_len, min_len=min_len
    )


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(st.sampled_from([0, 1, 2, 3, S]), min_size=1, max_size=80),
    old=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    new=st.lists(st.integers(0, 3), max_size=4),
    max_len=st.integers(1, 14),
)
def test_a_match_carried_from_the_last_step_finds_what_a_fresh_search_finds(text, old, new, max_len):
    """The main index's match at the last step narrows the next step's first probe to its rows
    (known tokens skipped); a range of a few rows is refuted one token longer by reading the
    tokens before it. Neither may change the answer."""
    idx = SuffixIndex(_a(text))
    tokens, sa = idx.tokens, idx.suffix_array
    n0, f0, l0 = kernels.longest_match(tokens, sa, _a(old), max_len, 1, 0)
    ctx = _a(old + new)
    want = kernels.longest_match(tokens, sa, ctx, max_len, 1, 0)
    if n0:
        carried = kernels.longest_match(tokens, sa, ctx, max_len, 1, n0 + len(new), n0, f0, l0)
        assert carried == want
    for hint in range(max_len + 2):  # refuting by the tokens before, from any hint
        assert kernels.longest_match(tokens, sa, ctx, max_len, 1, hint) == want
    if want[0]:  # the rows are exactly those holding the match
        pattern = ctx[ctx.size - want[0] :].tolist()
        held = [r for r in range(sa.size) if tokens[sa[r] : sa[r] + want[0]].tolist() == pattern]
        assert held == list(range(want[1], want[2]))


@settings(max_examples=100, deadline=None)
@given(text=texts, pattern=st.lists(st.integers(0, 3), min_size=1, max_size=5))
def test_match_range_count_equals_occurrences(text, pattern):
    idx = SuffixIndex(_a(text))
    first, last = _range(idx, pattern)
    # One SA row per occurrence of the pattern, and those rows are the occurrences.
    assert last - first == len(_occurrences(text, pattern))
    assert sorted(idx.suffix_array[first:last].tolist()) == _occurrences(text, pattern)


# -- continuations ---------------------------------------------------------------------------


def test_continuations_pad_after_separator_and_end():
    # "5 6" occurs at 0 (then 7 S), at 4 (then 8 9 5) and at 8 (end of text).
    idx = SuffixIndex(_a([5, 6, 7, S, 5, 6, 8, 9, 5, 6]))
    n, first, last = idx.longest_match(_a([5, 6]), max_len=4)
    assert (n, last - first) == (2, 3)
    rows, weights = idx.continuations(first, last, n, depth=3, samples=8)
    # One row per occurrence (in SA order, compared here as a set): after the end of the text or
    # a separator every position is -1.
    assert sorted(rows.tolist()) == [[-1, -1, -1], [7, -1, -1], [8, 9, 5]]
    # Three occurrences, three samples: each stands for one.
    assert weights.tolist() == [1.0, 1.0, 1.0]
    assert rows.dtype == np.int32


def test_continuations_padding_is_sticky_after_separator():
    # After "1" comes S then 2 3: once a separator is hit nothing after it may appear.
    idx = SuffixIndex(_a([1, S, 2, 3]))
    rows, _ = idx.continuations(*idx.longest_match(_a([1]), max_len=1)[1:], offset=1, depth=3, samples=4)
    assert rows.tolist() == [[-1, -1, -1]]


def test_continuations_empty_range_or_depth():
    idx = SuffixIndex(_a([1, 2, 3]))
    rows, weights = idx.continuations(1, 1, 1, depth=4, samples=8)
    # No rows in the range: nothing to continue, shape keeps the depth.
    assert rows.shape == (0, 4)
    assert weights.size == 0
    rows, weights = idx.continuations(0, 2, 1, depth=0, samples=8)
    # depth 0: no tokens asked for.
    assert rows.shape == (0, 0)


def test_continuations_sampling_bound_on_huge_range():
    idx = SuffixIndex(np.ones(1000, dtype=np.int32))
    n, first, last = idx.longest_match(_a([1]), max_len=1)
    # Every one of the 1000 positions is an occurrence of "1".
    assert last - first == 1000
    rows, weights = idx.continuations(first, last, n, depth=2, samples=7)
    # Never more than `samples` rows...
    assert rows.shape == (7, 2)
    # ...each standing for 1000 / 7 occurrences, so weights sum to the occurrence count.
    assert weights.sum() == pytest.approx(1000)


@settings(max_examples=100, deadline=None)
@given(
    text=st.lists(st.sampled_from([0, 1, 2, S]), min_size=1, max_size=60),
    data=st.data(),
)
def test_continuations_properties(text, data):
    idx = SuffixIndex(_a(text))
    first = data.draw(st.integers(0, len(text)))
    last = data.draw(st.integers(first, len(text)))
    samples = data.draw(st.integers(1, 6))
    offset = data.draw(st.integers(0, 3))
    depth = data.draw(st.integers(1, 5))
    rows, weights = idx.continuations(first, last, offset, depth, samples)
    count = last - first
    # At most `samples` rows, fewer only when the range itself is smaller.
    assert rows.shape == (min(count, samples), depth)
    # The weights account for every occurrence in the range.
    assert weights.sum() == pytest.approx(count)
    starts = idx.sample_starts(first, last, samples)
    for row, start in zip(rows.tolist(), starts.tolist(), strict=True):
        expect = []
        for j in range(depth):
            pos = start + offset + j
            if pos >= len(text) or text[pos] == S:
                break
            expect.append(text[pos])
        # Each row is the text after its suffix start, cut at a separator or the end, -1 padded.
        assert row == expect + [-1] * (depth - len(expect))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 31999, S]), max_size=60))
def test_separator_sorts_above_vocabulary_ids(text):
    # Ids renumber by counting over their range; the separator far above them takes the last rank.
    assert build_suffix_array(_a(text)).tolist() == _brute_sa(text)


def test_the_kernels_separator_is_the_request_separator():
    from indexer.kernels import suffix_sort

    assert suffix_sort.SEP == S

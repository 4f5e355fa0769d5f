import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.prompt_lookup import prompt_lookup, prompt_lookup_match


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _pl(ids, **kw):
    return prompt_lookup(_a(ids), **kw).tolist()


def test_trigram_match():
    # "1 2 3" occurred at 0, followed by "4 5 1".
    assert _pl([1, 2, 3, 4, 5, 1, 2, 3], num_tokens=3) == [4, 5, 1]


def test_longest_ngram_preferred_over_more_recent_shorter_one():
    # "2 3" occurs at 1 (then 9) and "3" alone at 4 (then 8): the bigram wins even though the
    # unigram occurrence is more recent.
    assert _pl([1, 2, 3, 9, 3, 8, 2, 3], num_tokens=1, max_n=2) == [9]


def test_most_recent_occurrence_wins():
    # "7" occurred at 0 (then 1) and at 2 (then 2): the later one is used.
    assert _pl([7, 1, 7, 2, 7], num_tokens=1) == [2]


def test_most_recent_occurrence_wins_for_bigrams():
    # "4 5" occurred at 0 (then 1) and at 3 (then 2); the last "4 5" is the context's own end.
    assert _pl([4, 5, 1, 4, 5, 2, 4, 5], num_tokens=1, max_n=2) == [2]


def test_no_repeat_gives_empty():
    out = prompt_lookup(_a([1, 2, 3]))
    # Nothing repeats: no draft (still an int32 array).
    assert out.tolist() == []
    assert out.dtype == np.int32


@pytest.mark.parametrize("ctx", [[], [5]])
def test_too_short_context_gives_empty(ctx):
    # Zero or one token: no earlier occurrence is possible.
    assert _pl(ctx) == []


def test_continuation_stops_at_end_of_context():
    # "1" occurred at 0; only "2 1" follow it before the context ends.
    assert _pl([1, 2, 1], num_tokens=10) == [2, 1]


def test_num_tokens_zero_gives_empty():
    # A match exists but no tokens were asked for.
    assert _pl([1, 2, 1], num_tokens=0) == []


def test_min_n_excludes_short_matches():
    # Only a unigram ("3") repeats; min_n=2 rules it out.
    assert _pl([3, 1, 2, 3], min_n=2, max_n=3) == []


def test_max_n_caps_ngram_length():
    # With max_n=1 only "3" is matched; its most recent earlier occurrence is at 4 (then 7).
    assert _pl([1, 2, 3, 9, 3, 7, 2, 3], max_n=1, num_tokens=1) == [7]


def test_overlapping_occurrence():
    # "1 1" ends the context; its latest earlier occurrence starts at 1 (then the final 1).
    assert _pl([1, 1, 1, 1], max_n=2, num_tokens=3) == [1]


def test_result_is_a_copy():
    ctx = _a([1, 2, 1])
    out = prompt_lookup(ctx)
    out[0] = 99
    # Writing into the draft never changes the context.
    assert ctx.tolist() == [1, 2, 1]


@pytest.mark.parametrize("kw", [{"min_n": 0}, {"min_n": 3, "max_n": 2}, {"num_tokens": -1}, {"min_n": -1, "max_n": -1}])
def test_invalid_arguments(kw):
    # Need 1 <= min_n <= max_n and num_tokens >= 0.
    with pytest.raises(ValueError):
        prompt_lookup(_a([1, 2, 1]), **kw)


def _brute(ctx, min_n, max_n, k):
    size = len(ctx)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        hits = [s for s in range(size - n) if ctx[s : s + n] == ctx[size - n :]]
        if hits:
            return ctx[hits[-1] + n : hits[-1] + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    ctx=st.lists(st.integers(0, 3), max_size=30),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_matches_brute_force(ctx, min_n, extra, k):
    # Longest n-gram in [min_n, max_n], its latest earlier occurrence, up to k following tokens.
    assert _pl(ctx, min_n=min_n, max_n=min_n + extra, num_tokens=k) == _brute(ctx, min_n, min_n + extra, k)


@settings(max_examples=200, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), max_size=30), max_n=st.integers(1, 4), k=st.integers(0, 6))
def test_match_reports_the_longest_ngram_that_matched(ctx, max_n, k):
    # The chain is the longest match's (any length from 1), and n is that match's length.
    want_n = next((n for n in range(max_n, 0, -1) if _brute(ctx, n, n, 1)), 0)
    chain, n = prompt_lookup_match(_a(ctx), max_n=max_n, num_tokens=k)
    assert (chain.tolist(), n) == (_brute(ctx, 1, max_n, k), want_n)


def test_match_rejects_bad_arguments():
    with pytest.raises(ValueError):
        prompt_lookup_match(_a([1, 2, 1]), max_n=0)

"""Compiled searches: suffix-array ranges and longest matches, continuation gathering, the
own-context scan and prompt lookup."""

from __future__ import annotations

import numpy as np
from numba import njit

# -- suffix array -------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _compare(tokens: np.ndarray, start: int, pattern: np.ndarray) -> int:
    """Sign of ``tokens[start:start+m]`` versus ``pattern`` (a suffix that ends first is smaller)."""
    return _compare_from(tokens, start, pattern, 0)


@njit(cache=True, nogil=True, inline="always")
def _lower_bound(tokens: np.ndarray, sa: np.ndarray, pattern: np.ndarray, lo: int, hi: int) -> int:
    """The first SA row in ``[lo, hi)`` whose suffix is not smaller than ``pattern``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if _compare(tokens, sa[mid], pattern) < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True, inline="always")
def _range_end(tokens: np.ndarray, sa: np.ndarray, pattern: np.ndarray, first: int, hi: int) -> int:
    """Given that row ``first`` starts with ``pattern``, the first row in ``(first, hi]`` that does
    not. Gallops from ``first``, then bisects: most ranges are short, so this reads a few rows
    near ``first`` instead of bisecting the whole array again."""
    lo = first + 1  # rows before lo match
    step = 1
    while True:
        probe = first + step
        if probe >= hi:
            break
        if _compare(tokens, sa[probe], pattern) != 0:
            hi = probe
            break
        lo = probe + 1
        step <<= 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if _compare(tokens, sa[mid], pattern) == 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True, inline="always")
def _first_row(tokens: np.ndarray, sa: np.ndarray, pattern: np.ndarray, size: int) -> int:
    """The first SA row whose suffix starts with ``pattern``, or -1 when none does."""
    row = _lower_bound(tokens, sa, pattern, 0, size)
    if row < size and _compare(tokens, sa[row], pattern) == 0:
        return row
    return -1


@njit(cache=True, nogil=True, inline="always")
def match_range(tokens: np.ndarray, sa: np.ndarray, pattern: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """SA rows in ``[lo, hi)`` whose suffixes start with ``pattern``, as ``(first, last)``."""
    first = _lower_bound(tokens, sa, pattern, lo, hi)
    if first >= hi or _compare(tokens, sa[first], pattern) != 0:
        return first, first
    return first, _range_end(tokens, sa, pattern, first, hi)


@njit(cache=True, nogil=True, inline="always")
def _compare_from(tokens: np.ndarray, start: int, pattern: np.ndarray, known: int) -> int:
    """:func:`_compare` for a suffix known to start with ``pattern[:known]``."""
    n = tokens.size
    for j in range(known, pattern.size):
        p = start + j
        if p >= n:
            return -1
        x = tokens[p]
        y = pattern[j]
        if x != y:
            return -1 if x < y else 1
    return 0


@njit(cache=True, nogil=True, inline="always")
def narrowed_range(
    tokens: np.ndarray, sa: np.ndarray, pattern: np.ndarray, known: int, lo: int, hi: int
) -> tuple[int, int]:
    """:func:`match_range` where SA rows ``[lo, hi)`` are all those starting with
    ``pattern[:known]`` (a match found before, now followed by more tokens): only they are
    searched, only past the known part."""
    if known >= pattern.size:
        return lo, hi
    a, b = lo, hi
    while a < b:
        mid = (a + b) >> 1
        if _compare_from(tokens, sa[mid], pattern, known) < 0:
            a = mid + 1
        else:
            b = mid
    first = a
    if first >= hi or _compare_from(tokens, sa[first], pattern, known) != 0:
        return first, first
    a, b = first + 1, hi
    while a < b:
        mid = (a + b) >> 1
        if _compare_from(tokens, sa[mid], pattern, known) == 0:
            a = mid + 1
        else:
            b = mid
    return first, a


@njit(cache=True, nogil=True, inline="always")
def _extends_left(tokens: np.ndarray, sa: np.ndarray, first: int, last: int, before: int) -> bool:
    """Whether some occurrence in SA rows ``[first, last)`` follows the token ``before``."""
    for r in range(first, last):
        p = sa[r]
        if p > 0 and tokens[p - 1] == before:
            return True
    return False


_SCAN = 16  # a match in at most this many rows is extended by reading what precedes each


@njit(cache=True, nogil=True)
def longest_match(
    tokens: np.ndarray,
    sa: np.ndarray,
    context: np.ndarray,
    max_len: int,
    min_len: int,
    hint: int,
    known: int = 0,
    lo: int = 0,
    hi: int = 0,
) -> tuple[int, int, int]:
    """Longest ``n`` in ``[min_len, max_len]`` whose last-``n`` context tokens occur: ``(n, first, last)``.

    Matching is monotone in ``n``, so a binary search over ``n`` works; ``hint`` is probed first
    (with ``hint + 1``), which settles the common case of a match that simply continued. When
    ``known`` > 0, SA rows ``[lo, hi)`` are all those starting with the hint's first ``known``
    tokens (the match an earlier search found, before the tokens since), so the hint's probe
    reads only them. A match held by a few rows is refuted one token longer by reading the
    token before each occurrence. The answer does not depend on the hint, only its cost does.
    """
    hi_n = min(max_len, context.size)
    size = sa.size
    if hi_n < min_len or size == 0:
        return 0, 0, 0
    best_n, best_f, best_l = 0, -1, -1
    lo_n = min_len - 1
    if min_len <= hint <= hi_n:
        pattern = context[context.size - hint :]
        if 0 < known <= hint and 0 <= lo < hi <= size:
            f, last = narrowed_range(tokens, sa, pattern, known, lo, hi)
        else:
            f, last = match_range(tokens, sa, pattern, 0, size)
        if f == last:
            hi_n = hint - 1
        else:
            lo_n, best_n, best_f, best_l = hint, hint, f, last
            if hint < hi_n:
                before = context[context.size - hint - 1]
                if last - f <= _SCAN and not _extends_left(tokens, sa, f, last, before):
                    hi_n = hint
                else:
                    f = _first_row(tokens, sa, context[context.size - hint - 1 :], size)
                    if f < 0:
                        hi_n = hint
                    else:
                        lo_n, best_n, best_f, best_l = hint + 1, hint + 1, f, -1
    while lo_n < hi_n:
        mid = (lo_n + hi_n + 1) >> 1
        f = _first_row(tokens, sa, context[context.size - mid :], size)
        if f >= 0:
            lo_n, best_n, best_f, best_l = mid, mid, f, -1
        else:
            hi_n = mid - 1
    if best_n == 0:
        return 0, 0, 0
    if best_l < 0:
        best_l = _range_end(tokens, sa, context[context.size - best_n :], best_f, size)
    return best_n, best_f, best_l


@njit(cache=True, nogil=True)
def gather_rows(tokens: np.ndarray, starts: np.ndarray, depth: int, stop: int) -> np.ndarray:
    """``depth`` tokens from each start, -1 from the first token >= ``stop`` (the separator) or
    past the end of ``tokens``."""
    rows = np.full((starts.size, depth), -1, dtype=np.int32)
    n = tokens.size
    for i in range(starts.size):
        for j in range(depth):
            p = starts[i] + j
            if p >= n or tokens[p] >= stop:
                break
            rows[i, j] = tokens[p]
    return rows


@njit(cache=True, nogil=True)
def sample_starts(sa: np.ndarray, first: int, last: int, samples: int) -> np.ndarray:
    """Suffix starts of up to ``samples`` evenly spaced SA rows in ``[first, last)``."""
    count = last - first
    k = min(count, samples)
    out = np.empty(k, dtype=np.int64)
    for i in range(k):
        out[i] = sa[first + (i * count) // k]
    return out


@njit(cache=True, nogil=True)
def sample_rows(
    tokens: np.ndarray, sa: np.ndarray, first: int, last: int, offset: int, depth: int, samples: int, stop: int
) -> np.ndarray:
    """:func:`sample_starts` (each moved ``offset`` on) then :func:`gather_rows`, in one call."""
    return gather_rows(tokens, sample_starts(sa, first, last, samples) + offset, depth, stop)


@njit(cache=True, nogil=True)
def _stacked_index(
    main_tokens: np.ndarray,
    main_sa: np.ndarray,
    run_tokens: np.ndarray,
    run_sa: np.ndarray,
    offsets: np.ndarray,
    i: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Index ``i`` of :func:`stacked_continuations` as ``(tokens, suffix array)``: the main
    index, then run ``i - 1``."""
    if i == 0:
        return main_tokens, main_sa
    return run_tokens[offsets[i - 1] : offsets[i]], run_sa[offsets[i - 1] : offsets[i]]


@njit(cache=True, nogil=True)
def stacked_continuations(
    main_tokens: np.ndarray,
    main_sa: np.ndarray,
    run_tokens: np.ndarray,
    run_sa: np.ndarray,
    offsets: np.ndarray,
    context: np.ndarray,
    max_len: int,
    hint: int,
    depth: int,
    samples: int,
    stop: int,
    main_prior: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> tuple[int, np.ndarray, np.ndarray, tuple[int, int, int]]:
    """The longest match of the context's suffix over a main index and delta runs stacked end
    to end (run ``i``: tokens and SA ``[offsets[i], offsets[i + 1])``), and the continuations
    after it: ``(n, rows, weights, main match)``, ``n == 0`` when nothing matches.

    Each index holding the longest match gets a share of the ``samples`` by how often it
    holds it, rounded up; a row stands for ``count / rows`` occurrences of its index. Later
    indexes are searched only for matches at least as long as the best so far. The main
    index's own longest match ``(n, first row, end row)`` comes back too: ``main_prior``
    ``(hint, known, lo, hi)`` passes one found before to the next search (see
    :func:`longest_match`; ``known`` 0: none).
    """
    n_idx = offsets.size  # the main index, then offsets.size - 1 runs
    lens = np.zeros(n_idx, dtype=np.int64)
    firsts = np.zeros(n_idx, dtype=np.int64)
    lasts = np.zeros(n_idx, dtype=np.int64)
    best = 0
    for i in range(n_idx):
        tok, sa = _stacked_index(main_tokens, main_sa, run_tokens, run_sa, offsets, i)
        if i == 0 and main_prior[1] > 0:
            n, f, last = longest_match(tok, sa, context, max_len, 1, main_prior[0], main_prior[1], main_prior[2],
                                       main_prior[3])  # fmt: skip
        else:
            n, f, last = longest_match(tok, sa, context, max_len, max(best, 1), hint)
        lens[i], firsts[i], lasts[i] = n, f, last
        if n > best:
            best = n
    main_match = (lens[0], firsts[0], lasts[0])
    if best == 0:
        return 0, np.zeros((0, depth), dtype=np.int32), np.zeros(0), main_match
    total = 0
    for i in range(n_idx):
        if lens[i] == best:
            total += lasts[i] - firsts[i]
    takes = np.zeros(n_idx, dtype=np.int64)
    for i in range(n_idx):
        if lens[i] == best:
            count = lasts[i] - firsts[i]
            takes[i] = min(count, -(-samples * count // total))
    rows = np.full((takes.sum(), depth), -1, dtype=np.int32)
    weights = np.empty(rows.shape[0])
    at = 0
    for i in range(n_idx):
        k = takes[i]
        if k == 0:
            continue
        tok, sa = _stacked_index(main_tokens, main_sa, run_tokens, run_sa, offsets, i)
        rows[at : at + k] = sample_rows(tok, sa, firsts[i], lasts[i], best, depth, k, stop)
        weights[at : at + k] = (lasts[i] - firsts[i]) / k
        at += k
    return best, rows, weights, main_match


# -- own context ----------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def tail_matches(ctx: np.ndarray, lo: int, max_len: int) -> tuple[int, np.ndarray]:
    """Longest match of the context's suffix among occurrences ending in ``[lo, len - 1)``, and
    the end positions that achieve it (ascending)."""
    size = ctx.size
    best = 0
    count = 0
    ends = np.empty(max(size - 1 - lo, 0), dtype=np.int64)
    if max_len < 1 or size < 2:
        return best, ends[:0]
    last = ctx[size - 1]
    for e in range(lo, size - 1):
        if ctx[e] != last:
            continue
        k = 1
        while k < max_len and e - k >= 0 and ctx[e - k] == ctx[size - 1 - k]:
            k += 1
        if k > best:
            best = k
            count = 0
        if k == best:
            ends[count] = e
            count += 1
    return best, ends[:count]


@njit(cache=True, nogil=True)
def context_continuations(
    ctx: np.ndarray,
    sa_tokens: np.ndarray,
    sa: np.ndarray,
    indexed: int,
    max_len: int,
    hint: int,
    depth: int,
    samples: int,
    stop: int,
) -> tuple[int, np.ndarray, np.ndarray]:
    """Continuations after earlier occurrences of the context's longest repeated suffix:
    ``(n, rows, weights)``, ``n == 0`` when none repeats.

    Occurrences in the first ``indexed`` tokens come from their suffix array (``sa`` over
    ``sa_tokens``; empty when nothing is indexed), the rest from :func:`tail_matches`. Where
    both hold the longest match, both contribute: up to ``samples`` evenly spaced SA rows and
    the ``samples`` most recent tail occurrences, each row standing for its share of its side.
    """
    n_sa, first, last = longest_match(sa_tokens, sa, ctx, max_len, 1, hint)
    n_tail, ends = tail_matches(ctx, indexed, max_len)
    n = max(n_sa, n_tail)
    if n == 0:
        return 0, np.zeros((0, depth), dtype=np.int32), np.zeros(0)
    k_sa = min(last - first, samples) if n_sa == n else 0
    k_tail = min(ends.size, samples) if n_tail == n else 0
    starts = np.empty(k_sa + k_tail, dtype=np.int64)
    weights = np.empty(k_sa + k_tail)
    if k_sa:
        starts[:k_sa] = sample_starts(sa, first, last, samples) + n
        weights[:k_sa] = (last - first) / k_sa
    if k_tail:
        starts[k_sa:] = ends[ends.size - k_tail :] + 1  # the most recent occurrences stand for all
        weights[k_sa:] = ends.size / k_tail
    return n, gather_rows(ctx, starts, depth, stop), weights


@njit(cache=True, nogil=True)
def context_followers(
    ctx: np.ndarray, sa_tokens: np.ndarray, sa: np.ndarray, indexed: int, since: int, ll: int, fl: int, keep: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`recent_followers` of the context's last ``ll`` tokens, the occurrences in its
    first ``indexed`` tokens found with their suffix array (``sa`` over ``sa_tokens``; empty
    when nothing is indexed) and the later ones by a scan."""
    if sa.size == 0 or ctx.size < ll:
        return recent_followers(ctx, sa[:0], 0, since, ll, fl, keep)
    leader = ctx[ctx.size - ll :]
    first, last = match_range(sa_tokens, sa, leader, 0, sa.size)
    return recent_followers(ctx, sa[first:last], max(0, indexed - ll + 1), since, ll, fl, keep)


@njit(cache=True, nogil=True)
def prompt_lookup_start(ctx: np.ndarray, min_n: int, max_n: int) -> int:
    """Where the tokens after the most recent earlier occurrence of the longest n-gram (``max_n``
    down to ``min_n``) ending the context start, or -1."""
    size = ctx.size
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for s in range(size - n - 1, -1, -1):  # latest window first, never the suffix itself
            ok = True
            for j in range(n):
                if ctx[s + j] != ctx[size - n + j]:
                    ok = False
                    break
            if ok:
                return s + n
    return -1


@njit(cache=True, nogil=True)
def recent_followers(
    ctx: np.ndarray, indexed_starts: np.ndarray, tail_from: int, since: int, ll: int, fl: int, keep: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``keep`` most recently seen distinct ``fl``-token followers of the context's last
    ``ll`` tokens, most recent first, with how often each followed them: ``(rows, counts)``.

    Occurrences start at ``since`` or later and have a complete follower. Those starting before
    ``tail_from`` come from an index (``indexed_starts``, any order); the rest are scanned here.
    For ``ctx = [1, 2, 9, 1, 2, 8, 1, 2, 9, 1, 2]``, ``ll = 2``, ``fl = 1``: ``[[9], [8]]`` with
    counts ``[2, 1]`` (9 followed "1 2" at starts 0 and 6, 8 at start 3).
    """
    n = ctx.size
    last = n - ll - fl  # the latest start with a complete follower
    rows = np.full((keep, fl), -1, dtype=np.int32)
    counts = np.zeros(keep)
    if keep < 1 or fl < 1 or ll < 1 or last < since:
        return rows[:0], counts[:0]
    starts = np.empty(max(0, last - max(since, tail_from) + 1) + indexed_starts.size, dtype=np.int64)
    m = 0
    for p in range(last, max(since, tail_from) - 1, -1):  # the tail, most recent first
        same = True
        for j in range(ll):
            if ctx[p + j] != ctx[n - ll + j]:
                same = False
                break
        if same:
            starts[m] = p
            m += 1
    indexed = np.sort(indexed_starts)[::-1]
    for p in indexed:
        if since <= p <= last and p < tail_from:
            starts[m] = p
            m += 1
    found = 0
    for i in range(m):
        at = starts[i] + ll
        row = -1
        for r in range(found):
            same = True
            for j in range(fl):
                if rows[r, j] != ctx[at + j]:
                    same = False
                    break
            if same:
                row = r
                break
        if row >= 0:
            counts[row] += 1
        elif found < keep:
            rows[found] = ctx[at : at + fl]
            counts[found] = 1
            found += 1
    return rows[:found], counts[:found]

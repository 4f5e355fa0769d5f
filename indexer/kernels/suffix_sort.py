"""Suffix array construction by induced sorting (SA-IS, Nong, Zhang and Chan 2009), compiled,
and the merge that extends a suffix array by appended text without sorting it again.

Tokens are first renumbered densely (1, 2, ... in their int32 order) with a virtual sentinel 0
appended, so the alphabet is at most the text's length and a suffix that is a prefix of another
sorts first. Time and memory are linear in the text, with no per-call floor: a 500-token run
sorts in microseconds, where a byte-oriented library call pays for a 64k-entry bucket table
(and sorts four bytes per token).

Request separators (``SEP``, the largest int32) end a suffix's key: each occurrence is renamed
apart, above every token and in text order, so two suffixes equal up to and including their
separators sort by position, and nothing after a separator ever decides an order. A suffix's
place then depends only on its own request, which is what lets :func:`merge_suffix_arrays` add
appended requests to a built array, and drop a cut-off head, instead of sorting everything
again. Searches never notice: a pattern holds no separator, so the rows starting with it are the
same set, and rows that trade places are equal up to their separators.
"""

from __future__ import annotations

import numpy as np
from numba import njit

SEP = 2147483647  # indexer.tokens.SEPARATOR (a test keeps the two equal)


@njit(cache=True, nogil=True)
def _bucket_bounds(counts: np.ndarray, ends: bool) -> np.ndarray:
    """Each symbol's first slot (or one past its last, with ``ends``) in the suffix array."""
    out = np.empty(counts.size, dtype=np.int64)
    total = 0
    for c in range(counts.size):
        total += counts[c]
        out[c] = total if ends else total - counts[c]
    return out


@njit(cache=True, nogil=True)
def _induce(s: np.ndarray, stype: np.ndarray, sa: np.ndarray, counts: np.ndarray) -> None:
    """From LMS suffixes placed (in order) at their buckets' ends, the L suffixes left to right,
    then the S suffixes right to left."""
    n = s.size
    heads = _bucket_bounds(counts, False)
    for i in range(n):
        j = sa[i] - 1
        if j >= 0 and not stype[j]:
            c = s[j]
            sa[heads[c]] = j
            heads[c] += 1
    tails = _bucket_bounds(counts, True)
    for i in range(n - 1, -1, -1):
        j = sa[i] - 1
        if j >= 0 and stype[j]:
            c = s[j]
            tails[c] -= 1
            sa[tails[c]] = j


@njit(cache=True, nogil=True)
def _is_lms(stype: np.ndarray, i: int) -> bool:
    return i > 0 and stype[i] and not stype[i - 1]


@njit(cache=True, nogil=True)
def _sais(s: np.ndarray, k: int) -> np.ndarray:
    """Suffix array of ``s`` (int32 symbols in ``[0, k)``, ending with its only 0)."""
    n = s.size
    sa = np.full(n, -1, dtype=np.int32)
    if n == 1:
        sa[0] = 0
        return sa
    stype = np.zeros(n, dtype=np.bool_)  # S: smaller than the suffix after it
    stype[n - 1] = True
    for i in range(n - 2, -1, -1):
        stype[i] = s[i] < s[i + 1] or (s[i] == s[i + 1] and stype[i + 1])
    counts = np.zeros(k, dtype=np.int64)
    for i in range(n):
        counts[s[i]] += 1

    # 1. Sort the LMS substrings: LMS suffixes in text order at their buckets' ends, induced.
    tails = _bucket_bounds(counts, True)
    for i in range(n - 1, 0, -1):
        if _is_lms(stype, i):
            c = s[i]
            tails[c] -= 1
            sa[tails[c]] = i
    _induce(s, stype, sa, counts)

    # 2. Name them: equal LMS substrings share a name. The sorted LMS positions move to the
    # front; names go in the back half at p // 2 (LMS positions are at least 2 apart).
    m = 0
    for i in range(n):
        p = sa[i]
        if _is_lms(stype, p):
            sa[m] = p
            m += 1
    sa[m:] = -1
    names = 0
    prev = -1
    for i in range(m):
        p = sa[i]
        differs = prev < 0
        d = 0
        while not differs:
            if s[p + d] != s[prev + d] or stype[p + d] != stype[prev + d]:
                differs = True
            elif d > 0 and _is_lms(stype, p + d):  # types agree so far: both substrings end here
                break
            d += 1
        if differs:
            names += 1
            prev = p
        sa[m + p // 2] = names - 1
    reduced = np.empty(m, dtype=np.int32)
    j = 0
    for i in range(m, n):
        if sa[i] >= 0:
            reduced[j] = sa[i]
            j += 1

    # 3. Order the LMS suffixes: by recursion unless every name is unique.
    if names < m:
        order = _sais(reduced, names)
    else:
        order = np.empty(m, dtype=np.int32)
        for i in range(m):
            order[reduced[i]] = i
    lms = np.empty(m, dtype=np.int32)
    j = 0
    for i in range(1, n):
        if _is_lms(stype, i):
            lms[j] = i
            j += 1

    # 4. Induce the whole order from the sorted LMS suffixes.
    sa[:] = -1
    tails = _bucket_bounds(counts, True)
    for i in range(m - 1, -1, -1):
        p = lms[order[i]]
        c = s[p]
        tails[c] -= 1
        sa[tails[c]] = p
    _induce(s, stype, sa, counts)
    return sa


@njit(cache=True, nogil=True)
def _dense(tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """``tokens`` renumbered 1.. in order, with a 0 sentinel appended; and the alphabet size.
    Every separator gets a number of its own, above all tokens and rising along the text.

    Ids are renumbered by counting over their range; the largest value may lie far above the
    rest (the request separator) and takes the last numbers. Other sparse ranges are sorted."""
    n = tokens.size
    out = np.empty(n + 1, dtype=np.int32)
    out[n] = 0
    lo = np.int64(tokens[0])
    top = lo
    for i in range(n):
        lo = min(lo, np.int64(tokens[i]))
        top = max(top, np.int64(tokens[i]))
    hi = lo  # the largest value below the top
    for i in range(n):
        if tokens[i] != top:
            hi = max(hi, np.int64(tokens[i]))
    names = 0
    if hi - lo > 4 * n + 4096:
        order = np.argsort(tokens, kind="mergesort")  # stable: separators stay in text order
        for i in range(n):
            t = tokens[order[i]]
            if i == 0 or t == SEP or t != tokens[order[i - 1]]:
                names += 1
            out[order[i]] = names
        return out, names + 1
    rank = np.zeros(hi - lo + 1, dtype=np.int32)
    for i in range(n):
        if tokens[i] != top:
            rank[tokens[i] - lo] = 1
    for v in range(rank.size):
        if rank[v]:
            names += 1
            rank[v] = names
    if top != SEP:
        names += 1  # the top value: one number
    for i in range(n):
        if tokens[i] != top:
            out[i] = rank[tokens[i] - lo]
        elif top == SEP:
            names += 1
            out[i] = names
        else:
            out[i] = names
    return out, names + 1


@njit(cache=True, nogil=True)
def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes of the int32 ``tokens`` in lexicographic order (a suffix
    before any longer one it begins), separators each ranked apart (see the module's notes)."""
    if tokens.size == 0:
        return np.zeros(0, dtype=np.int32)
    s, k = _dense(tokens)
    return _sais(s, k)[1:].copy()  # the sentinel's suffix sorts first


@njit(cache=True, nogil=True)
def lcp(tokens: np.ndarray, sa: np.ndarray) -> np.ndarray:
    """``out[i]``: the common prefix length of suffixes ``sa[i - 1]`` and ``sa[i]`` (``out[0] =
    0``), in linear time. Going through the text in order, each suffix shares at least one token
    fewer with its predecessor in the array than the suffix before it did (Kasai et al. 2001);
    the predecessors are looked up by text position (Karkkainen, Manzini and Puglisi 2009's
    permuted LCP), which keeps the comparisons' reads in text order. A common prefix stops
    before a separator: each one is a symbol of its own, as in :func:`suffix_array`."""
    n = sa.size
    out = np.zeros(n, dtype=np.int32)
    if n == 0:
        return out
    prev = np.empty(n, dtype=np.int32)  # the suffix before each one in the array, by position
    prev[sa[0]] = -1
    for r in range(1, n):
        prev[sa[r]] = sa[r - 1]
    h = 0
    for i in range(n):  # prev[i] becomes the permuted LCP of suffix i
        j = prev[i]
        if j < 0:
            h = 0
        else:
            while i + h < n and j + h < n and tokens[i + h] == tokens[j + h] and tokens[i + h] != SEP:
                h += 1
        prev[i] = h
        if h > 0:
            h -= 1
    for r in range(1, n):
        out[r] = prev[sa[r]]
    return out


@njit(cache=True, nogil=True, inline="always")
def _sorts_first(tokens: np.ndarray, a: int, b: int) -> bool:
    """Whether the suffix at ``a`` sorts before the one at ``b > a`` (both reach a separator)."""
    k = 0
    while True:
        x = tokens[a + k]
        y = tokens[b + k]
        if x != y:
            return x < y
        if x == SEP:  # equal up to their separators: the earlier one first
            return True
        k += 1


@njit(cache=True, nogil=True)
def merge_suffix_arrays(tokens: np.ndarray, old_sa: np.ndarray, dropped: int, new_sa: np.ndarray) -> np.ndarray:
    """The suffix array of ``tokens``, which are an older text less its first ``dropped``
    tokens, then appended text: ``old_sa`` is the older text's suffix array and ``new_sa`` the
    appended text's own (positions from its start). Both parts end with a separator.

    The older suffixes keep their order (less the dropped ones, moved ``dropped`` back); each
    appended suffix goes in after the older ones that sort before it, found by bisection from
    where the previous one went. ``len(new_sa) * log(len(old_sa))`` comparisons, and one pass to
    write: a fraction of sorting the whole text again when the appended part is small."""
    base = tokens.size - new_sa.size  # where the appended text starts
    kept = np.empty(old_sa.size, dtype=np.int32)
    s = 0
    for i in range(old_sa.size):
        p = old_sa[i]
        if p >= dropped:
            kept[s] = p - dropped
            s += 1
    out = np.empty(s + new_sa.size, dtype=np.int32)
    w = 0
    lo = 0
    for d in range(new_sa.size):
        b = new_sa[d] + base
        a, hi = lo, s
        while a < hi:
            mid = (a + hi) >> 1
            if _sorts_first(tokens, kept[mid], b):
                a = mid + 1
            else:
                hi = mid
        out[w : w + a - lo] = kept[lo:a]
        w += a - lo
        out[w] = b
        w += 1
        lo = a
    out[w:] = kept[lo:s]
    return out

"""Compiled inner loops (numba, as vLLM's n-gram proposer does): suffix-array searches, the
own-context scan and the draft-tree merge. Everything else stays in numpy.

Each kernel is plain Python over numpy arrays; ``NUMBA_DISABLE_JIT=1`` runs them uncompiled
for debugging. Compiled code is cached beside the module, so only the first process on a machine
pays the compile time; :func:`warm_up` pays it at start-up rather than on a first request.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# -- suffix array -------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _compare(tokens: np.ndarray, start: int, pattern: np.ndarray) -> int:
    """Sign of ``tokens[start:start+m]`` versus ``pattern`` (a suffix that ends first is smaller)."""
    n = tokens.size
    for j in range(pattern.size):
        p = start + j
        if p >= n:
            return -1
        x = tokens[p]
        y = pattern[j]
        if x != y:
            return -1 if x < y else 1
    return 0


@njit(cache=True, nogil=True)
def match_range(tokens: np.ndarray, sa: np.ndarray, pattern: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """SA rows in ``[lo, hi)`` whose suffixes start with ``pattern``, as ``(first, last)``."""
    end = hi
    while lo < hi:
        mid = (lo + hi) >> 1
        if _compare(tokens, sa[mid], pattern) < 0:
            lo = mid + 1
        else:
            hi = mid
    if lo >= end or _compare(tokens, sa[lo], pattern) != 0:
        return lo, lo
    first = lo
    hi = end
    while lo < hi:
        mid = (lo + hi) >> 1
        if _compare(tokens, sa[mid], pattern) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return first, lo


@njit(cache=True, nogil=True)
def longest_match(
    tokens: np.ndarray, sa: np.ndarray, context: np.ndarray, max_len: int, min_len: int, hint: int
) -> tuple[int, int, int]:
    """Longest ``n`` in ``[min_len, max_len]`` whose last-``n`` context tokens occur: ``(n, first, last)``.

    Matching is monotone in ``n``, so a binary search over ``n`` works; ``hint`` is probed first
    (with ``hint + 1``), which settles the common case of a match that simply continued.
    """
    hi_n = min(max_len, context.size)
    size = sa.size
    best_n, best_f, best_l = 0, 0, 0
    if hi_n < min_len or size == 0:
        return best_n, best_f, best_l
    lo_n = min_len - 1
    if min_len <= hint <= hi_n:
        f, last = match_range(tokens, sa, context[context.size - hint :], 0, size)
        if f == last:
            hi_n = hint - 1
        else:
            lo_n, best_n, best_f, best_l = hint, hint, f, last
            if hint < hi_n:
                f, last = match_range(tokens, sa, context[context.size - hint - 1 :], 0, size)
                if f == last:
                    return best_n, best_f, best_l
                lo_n, best_n, best_f, best_l = hint + 1, hint + 1, f, last
    while lo_n < hi_n:
        mid = (lo_n + hi_n + 1) >> 1
        f, last = match_range(tokens, sa, context[context.size - mid :], 0, size)
        if f < last:
            lo_n, best_n, best_f, best_l = mid, mid, f, last
        else:
            hi_n = mid - 1
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


# -- frozen n-gram tables -----------------------------------------------------------------------


@njit(cache=True, nogil=True)
def follower_lengths(tokens: np.ndarray, sa: np.ndarray, leader_len: int, follower_len: int, stop: int) -> np.ndarray:
    """Per SA row: how many follower tokens (at most ``follower_len``) follow a clean leader of
    ``leader_len`` tokens at that suffix before a token >= ``stop`` (0 if the leader isn't clean)."""
    out = np.zeros(sa.size, dtype=np.int64)
    n = tokens.size
    want = leader_len + follower_len
    for i in range(sa.size):
        s = sa[i]
        k = 0
        while k < want and s + k < n and tokens[s + k] < stop:
            k += 1
        if k > leader_len:
            out[i] = k - leader_len
    return out


@njit(cache=True, nogil=True)
def prefix_counts(lcp: np.ndarray, flen: np.ndarray, rep: np.ndarray, leader_len: int, follower_len: int) -> np.ndarray:
    """For each representative row, the size of its run of rows sharing ``leader_len + j``
    tokens (counting rows with at least ``j`` follower tokens), for ``j = 1 .. follower_len``."""
    m = lcp.size
    counts = np.zeros((rep.size, follower_len), dtype=np.int32)
    for j in range(1, follower_len + 1):
        rp = 0
        cnt = 0
        for i in range(m + 1):
            if i == m or (i > 0 and lcp[i] < leader_len + j):
                while rp < rep.size and rep[rp] < i:
                    if flen[rep[rp]] >= j:
                        counts[rp, j - 1] = cnt
                    rp += 1
                cnt = 0
            if i < m and flen[i] >= j:
                cnt += 1
    return counts


@njit(cache=True, nogil=True)
def top_per_group(group: np.ndarray, score: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest scores within each run of equal ``group`` values (runs are
    contiguous), ties to the lower index, in (group, -score, index) order."""
    out = np.empty(group.size, dtype=np.int64)
    taken = 0
    start = 0
    n = group.size
    while start < n:
        stop = start + 1
        while stop < n and group[stop] == group[start]:
            stop += 1
        order = np.argsort(-score[start:stop], kind="mergesort")
        for t in range(min(k, order.size)):
            out[taken] = start + order[t]
            taken += 1
        start = stop
    return out[:taken]


# -- hashing --------------------------------------------------------------------------------------

_PRIME = np.uint64(0x100000001B3)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


@njit(cache=True, nogil=True)
def hash_tokens(tokens: np.ndarray, start: int, length: int) -> np.uint64:
    """64-bit hash of ``tokens[start:start+length]`` (FNV-style, then one mixing round)."""
    h = np.uint64(0)
    for j in range(length):
        h = h * _PRIME + np.uint64(tokens[start + j]) + np.uint64(1)
    h ^= h >> np.uint64(31)
    return h * _MIX


@njit(cache=True, nogil=True)
def hash_rows(mat: np.ndarray) -> np.ndarray:
    """:func:`hash_tokens` of every row of a 2-D int32 matrix."""
    out = np.empty(mat.shape[0], dtype=np.uint64)
    for i in range(mat.shape[0]):
        out[i] = hash_tokens(mat[i], 0, mat.shape[1])
    return out


@njit(cache=True, nogil=True)
def find_leader(context: np.ndarray, leader_len: int, keys: np.ndarray) -> int:
    """Index in the sorted ``keys`` of the hash of the context's last ``leader_len`` tokens, or -1."""
    if leader_len > context.size or keys.size == 0:
        return -1
    h = hash_tokens(context, context.size - leader_len, leader_len)
    i = int(np.searchsorted(keys, h))
    return i if i < keys.size and keys[i] == h else -1


@njit(cache=True, nogil=True)
def find_longest_leader(context: np.ndarray, orders: np.ndarray, keys: np.ndarray, owner: np.ndarray) -> int:
    """Index into ``keys`` of the longest leader (``orders`` longest first) ending the context,
    or -1. ``keys`` are all tables' leader hashes, sorted; ``owner`` says which order each is."""
    n = context.size
    for t in range(orders.size):
        ll = orders[t]
        if ll > n:
            continue
        h = hash_tokens(context, n - ll, ll)
        i = int(np.searchsorted(keys, h))
        while i < keys.size and keys[i] == h:
            if owner[i] == t:
                return i
            i += 1
    return -1


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


# -- tree merge -----------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _row_order(rows: np.ndarray) -> np.ndarray:
    """Stable lexicographic order of rows (-1, an ended row, sorts first): merge sort."""
    r = rows.shape[0]
    order = np.arange(r)
    tmp = np.empty(r, dtype=np.int64)
    width = 1
    while width < r:
        for start in range(0, r, 2 * width):
            mid = min(start + width, r)
            stop = min(start + 2 * width, r)
            i, j, k = start, mid, start
            while i < mid and j < stop:
                a, b = order[i], order[j]
                less = False  # rows[b] < rows[a]?
                for d in range(rows.shape[1]):
                    if rows[a, d] != rows[b, d]:
                        less = rows[b, d] < rows[a, d]
                        break
                if less:
                    tmp[k] = b
                    j += 1
                else:
                    tmp[k] = a
                    i += 1
                k += 1
            while i < mid:
                tmp[k] = order[i]
                i += 1
                k += 1
            while j < stop:
                tmp[k] = order[j]
                j += 1
                k += 1
        order, tmp = tmp, order
        width *= 2
    return order


@njit(cache=True, nogil=True)
def _best(score: np.ndarray, skip: np.ndarray, min_score: float, m: int) -> np.ndarray:
    """Ids of the ``m`` highest scores above ``min_score`` not in ``skip``; ties to lower ids."""
    if m <= 0:
        return np.zeros(0, dtype=np.int64)
    buf = np.empty(m, dtype=np.int64)  # sorted best first
    size = 0
    for node in range(score.size):
        v = score[node]
        if skip[node] or v <= min_score or (size == m and v <= score[buf[m - 1]]):
            continue
        pos = size if size < m else m - 1
        while pos > 0 and score[buf[pos - 1]] < v:  # equal scores stay ahead (lower ids)
            if pos < m:
                buf[pos] = buf[pos - 1]
            pos -= 1
        buf[pos] = node
        if size < m:
            size += 1
    return buf[:size]


@njit(cache=True, nogil=True)
def merge_tree(
    rows: np.ndarray,
    vals: np.ndarray,
    is_max: np.ndarray,
    tiers: np.ndarray,
    n_tiers: int,
    budget: int,
    min_score: float,
    depth_reserve: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Trie of all rows; per node and tier the summed (weights) or best (probs) value; keep the
    reserved best chain and then the highest scores, parents first.

    Returns ``(tokens, parents, sources, scores, first_token, first_value)``, the last two per
    tier: its best first-level token (-1 if none) and that token's value.
    """
    r_count, depth = rows.shape
    order = _row_order(rows)
    ids = np.full((depth, r_count), -1, dtype=np.int64)
    differs = np.zeros(r_count, dtype=np.bool_)
    cap = r_count * depth
    token = np.empty(cap, dtype=np.int32)
    parent = np.empty(cap, dtype=np.int64)
    n = 0
    n_first = 0
    for d in range(depth):
        for i in range(r_count):
            row = order[i]
            t = rows[row, d]
            if i > 0 and rows[order[i - 1], d] != t:
                differs[i] = True
            if t < 0:
                continue
            if i == 0 or differs[i] or ids[d, i - 1] < 0:
                token[n] = t
                parent[n] = ids[d - 1, i] if d > 0 else -1
                n += 1
            ids[d, i] = n - 1
        if d == 0:
            n_first = n
    per = np.zeros((max(n, 1), n_tiers))
    for d in range(depth):
        for i in range(r_count):
            node = ids[d, i]
            if node < 0:
                continue
            row = order[i]
            t = tiers[row]
            v = vals[row, d]
            if is_max[row]:
                if v > per[node, t]:
                    per[node, t] = v
            else:
                per[node, t] += v
    score = np.empty(n)
    source = np.zeros(n, dtype=np.uint8)
    for node in range(n):
        total = 0.0
        best_t = 0
        for t in range(n_tiers):
            total += per[node, t]
            if per[node, t] > per[node, best_t]:
                best_t = t
        score[node] = min(total, 1.0)
        source[node] = best_t
    # Children of a node are consecutive ids (depth-major numbering over sorted rows).
    child_lo = np.full(n + 1, n, dtype=np.int64)  # slot 0 is the root
    child_hi = np.zeros(n + 1, dtype=np.int64)
    child_lo[0], child_hi[0] = 0, n_first
    for d in range(depth - 1):
        for i in range(r_count):
            node, child = ids[d, i], ids[d + 1, i]
            if node >= 0 and child >= 0:
                child_lo[node + 1] = min(child_lo[node + 1], child)
                child_hi[node + 1] = max(child_hi[node + 1], child + 1)
    chosen = np.zeros(n, dtype=np.bool_)
    taken = 0
    # Depth reserve: the greedy best chain (ties to the lower id) goes in first.
    node = -1
    while taken < min(depth_reserve, budget):
        best = -1
        for c in range(child_lo[node + 1], child_hi[node + 1]):
            if score[c] > min_score and (best < 0 or score[c] > score[best]):
                best = c
        if best < 0:
            break
        chosen[best] = True
        taken += 1
        node = best
    # Then the best remaining scores (ties to the lower id). Scores never grow from parent to
    # child and a parent's id is lower, so the kept set stays a tree with every parent kept.
    for node in _best(score, chosen, min_score, budget - taken):
        chosen[node] = True
        taken += 1
    remap = np.full(n, -1, dtype=np.int64)
    out_tok = np.empty(taken, dtype=np.int32)
    out_par = np.empty(taken, dtype=np.int32)
    out_src = np.empty(taken, dtype=np.uint8)
    out_score = np.empty(taken, dtype=np.float32)
    k = 0
    for node in range(n):
        if chosen[node]:
            remap[node] = k
            out_tok[k] = token[node]
            out_par[k] = remap[parent[node]] if parent[node] >= 0 else -1
            out_src[k] = source[node]
            out_score[k] = score[node]
            k += 1
    first_tok = np.full(n_tiers, -1, dtype=np.int64)
    first_val = np.zeros(n_tiers)
    for node in range(n_first):
        for t in range(n_tiers):
            if per[node, t] > first_val[t]:
                first_val[t] = per[node, t]
                first_tok[t] = token[node]
    return out_tok, out_par, out_src, out_score, first_tok, first_val


def warm_up() -> None:
    """Compile (or load from cache) every kernel now, off any request's path."""
    toks = np.array([1, 2, 1, 2, 2147483647], dtype=np.int32)
    sa = np.array([0, 2, 1, 3, 4], dtype=np.int32)
    longest_match(toks, sa, np.array([1, 2], dtype=np.int32), 4, 1, 0)
    tail_matches(np.array([1, 2, 1], dtype=np.int32), 0, 4)
    prompt_lookup_start(np.array([1, 2, 1], dtype=np.int32), 1, 3)
    find_leader(np.array([1, 2], dtype=np.int32), 2, np.zeros(1, dtype=np.uint64))
    hash_rows(np.zeros((1, 2), dtype=np.int32))
    rows = np.array([[1, 2], [1, -1]], dtype=np.int32)
    merge_tree(rows, np.ones((2, 2)), np.zeros(2, dtype=np.bool_), np.zeros(2, dtype=np.int64), 7, 4, 0.0, 1)

"""Compiled passes for frozen n-gram tables: follower lengths, leader runs, each kept leader's
top-k followers with their prefix counts, and the leader hashes used to find them."""

from __future__ import annotations

import numpy as np
from numba import njit

# -- frozen n-gram tables -----------------------------------------------------------------------


@njit(cache=True, nogil=True)
def follower_lengths(tokens: np.ndarray, sa: np.ndarray, leader_len: int, follower_len: int, stop: int) -> np.ndarray:
    """Per SA row: how many follower tokens (at most ``follower_len``, at most 64) follow a clean
    leader of ``leader_len`` tokens at that suffix before a token >= ``stop`` (0 if the leader
    isn't clean). One byte a row: a table's build holds this for every token."""
    out = np.zeros(sa.size, dtype=np.uint8)
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
def leader_runs(lcp: np.ndarray, flen: np.ndarray, leader_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of SA rows sharing their first ``leader_len`` tokens (a leader each): their
    first rows (and the row count at the end), and per run how many of its rows have a
    follower (``flen > 0``)."""
    n = lcp.size
    runs = 0
    for i in range(n):
        if i == 0 or lcp[i] < leader_len:
            runs += 1
    firsts = np.empty(runs + 1, dtype=np.int32)
    counts = np.zeros(runs, dtype=np.int32)
    r = -1
    for i in range(n):
        if i == 0 or lcp[i] < leader_len:
            r += 1
            firsts[r] = i
        if flen[i] > 0:
            counts[r] += 1
    firsts[runs] = n
    return firsts, counts


@njit(cache=True, nogil=True)
def _distinct_followers(
    lcp: np.ndarray,
    flen: np.ndarray,
    a: int,
    b: int,
    leader_len: int,
    follower_len: int,
    reps: np.ndarray,
    counts: np.ndarray,
) -> int:
    """The distinct followers of the leader run of SA rows ``[a, b)``: each one's first row in
    ``reps`` and in ``counts[t, j]`` how many of the run's rows share the leader and its first
    ``j + 1`` tokens. Returns how many there are. A distinct follower is the first row of each
    block of rows sharing the leader and its whole follower (``lcp < leader_len + flen``)."""
    m = 0
    for i in range(a, b):
        if flen[i] > 0 and (i == a or lcp[i] < leader_len + flen[i]):
            reps[m] = i
            m += 1
    counts[:m] = 0
    for j in range(1, follower_len + 1):  # blocks of rows sharing leader + j tokens
        rp = 0
        cnt = 0
        for i in range(a, b + 1):
            if i == b or (i > a and lcp[i] < leader_len + j):
                while rp < m and reps[rp] < i:
                    if flen[reps[rp]] >= j:
                        counts[rp, j - 1] = cnt
                    rp += 1
                cnt = 0
            if i < b and flen[i] >= j:
                cnt += 1
    return m


@njit(cache=True, nogil=True)
def table_entries(
    lcp: np.ndarray,
    flen: np.ndarray,
    sa: np.ndarray,
    firsts: np.ndarray,
    kept: np.ndarray,
    leader_len: int,
    follower_len: int,
    top_k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each kept leader run (``kept`` indexes ``firsts``), its ``top_k`` distinct followers
    by expected accepted length (the sum of their prefix counts): ``(run, start, flen, counts)``
    per entry, runs in order, each run's entries best first (ties to the earlier row). ``start``
    is a suffix start of the follower's leader, ``counts[e, j]`` how many of the run's rows share
    the leader and the follower's first ``j + 1`` tokens. Each run is done on its own, in one
    scratch of its size, so nothing of the text's size is allocated."""
    longest = 0
    for r in kept:
        longest = max(longest, firsts[r + 1] - firsts[r])
    reps = np.empty(longest, dtype=np.int64)
    scratch = np.zeros((longest, follower_len), dtype=np.int32)
    score = np.empty(longest, dtype=np.int64)
    taken = np.zeros(longest, dtype=np.bool_)
    cap = kept.size * top_k
    run_of, starts, lens = np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int64)
    counts = np.zeros((cap, follower_len), dtype=np.int32)
    e = 0
    for r in kept:
        m = _distinct_followers(lcp, flen, firsts[r], firsts[r + 1], leader_len, follower_len, reps, scratch)
        for t in range(m):
            score[t] = scratch[t].sum()
            taken[t] = False
        for _ in range(min(top_k, m)):
            best = -1
            for t in range(m):
                if not taken[t] and (best < 0 or score[t] > score[best]):
                    best = t
            taken[best] = True
            run_of[e], starts[e], lens[e] = r, sa[reps[best]], flen[reps[best]]
            counts[e] = scratch[best]
            e += 1
    return run_of[:e], starts[:e], lens[:e], counts[:e]


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

"""Compiled passes for frozen n-gram tables: follower lengths, prefix counts, per-leader
top-k, and the leader hashes used to find them."""

from __future__ import annotations

import numpy as np
from numba import njit

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

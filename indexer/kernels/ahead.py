"""Pre-speculation's compiled parts: where verifying a tree likely ends (for a batch, read from
the trees the sessions' store holds), and the subtree under a root child."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from indexer.kernels.store import I32_PER_ROW, I64_PER_ROW, STATE, TREE, TREE_SIZE, tree_views


@njit(cache=True, nogil=True)
def _stops(
    tokens: np.ndarray,
    parents: np.ndarray,
    scores: np.ndarray,
    k: int,
    path_tokens: np.ndarray,
    kid_tokens: np.ndarray,
    path_end: np.ndarray,
    kid_end: np.ndarray,
    at: np.ndarray,
) -> None:
    """Append the tree's ``k`` likeliest stopping points, best first (see
    :func:`stopping_points`): each one's accepted path to ``path_tokens`` and its children's
    tokens to ``kid_tokens``, their ends to ``path_end`` and ``kid_end``. ``at`` holds
    (points, path tokens, kid tokens) used so far."""
    n = tokens.size
    ends = np.empty(n + 1)  # slot 0 is the root (score 1), slot i + 1 node i
    ends[0] = 1.0
    for i in range(n):
        ends[i + 1] = np.float64(scores[i])
    for i in range(n):
        ends[parents[i] + 1] -= np.float64(scores[i])
    taken = np.zeros(n + 1, dtype=np.bool_)
    for _ in range(min(k, n + 1)):
        best = -1
        for s in range(n + 1):  # the highest chance, ties to the earlier slot
            if not taken[s] and (best < 0 or ends[s] > ends[best]):
                best = s
        taken[best] = True
        p, pa, ka = at[0], at[1], at[2]
        depth = 0
        node = best - 1
        while node >= 0:
            depth += 1
            node = parents[node]
        node = best - 1
        for d in range(depth - 1, -1, -1):  # root first
            path_tokens[pa + d] = tokens[node]
            node = parents[node]
        for i in range(n):
            if parents[i] == best - 1:
                kid_tokens[ka] = tokens[i]
                ka += 1
        path_end[p] = pa + depth
        kid_end[p] = ka
        at[0], at[1], at[2] = p + 1, pa + depth, ka


@njit(cache=True, nogil=True)
def stopping_points(
    tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ``k`` likeliest places verification of a tree ends, best first: a node's score
    estimates the chance it is accepted, so verification ends exactly at it with about its
    score less its children's (the root's score being 1); ties go to the earlier node, the root
    first. Returns ``(path_tokens, path_ends, kid_tokens, kid_ends)``: point ``i``'s accepted
    path (root first) and its node's children's tokens, end to end."""
    n = tokens.size
    m = max(0, min(k, n + 1))
    path_tokens = np.empty(m * n, dtype=np.int32)
    kid_tokens = np.empty(m * n, dtype=np.int32)
    path_end = np.empty(m, dtype=np.int64)
    kid_end = np.empty(m, dtype=np.int64)
    at = np.zeros(3, dtype=np.int64)
    _stops(tokens, parents, scores, k, path_tokens, kid_tokens, path_end, kid_end, at)
    return path_tokens[: at[1]], path_end, kid_tokens[: at[2]], kid_end


@njit(cache=True, nogil=True)
def stopping_points_rows(
    i32: Any, i64: Any, rows: np.ndarray, ks: np.ndarray, reach: np.ndarray, reach_at: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`stopping_points` of the last tree of the session at each store row ``rows[j]``
    (none without a tree), ``ks[j]`` of them, by each node's probability of being accepted:
    ``reach[reach_at[j]:]`` for row ``j`` (one per node), or its stored scores where
    ``reach_at[j]`` is -1. Returns ``(owner, path_tokens, path_ends, kid_tokens, kid_ends)``,
    ``owner`` giving each point's ``j``; a session's points are consecutive, best first."""
    cap_points = 0
    cap_tokens = 0
    for j in range(rows.size):
        n = i64[rows[j] * I64_PER_ROW + STATE][TREE_SIZE]
        if n >= 0 and ks[j] > 0:
            m = min(ks[j], n + 1)
            cap_points += m
            cap_tokens += m * n
    owner = np.empty(cap_points, dtype=np.int64)
    path_tokens = np.empty(cap_tokens, dtype=np.int32)
    kid_tokens = np.empty(cap_tokens, dtype=np.int32)
    path_end = np.empty(cap_points, dtype=np.int64)
    kid_end = np.empty(cap_points, dtype=np.int64)
    at = np.zeros(3, dtype=np.int64)
    for j in range(rows.size):
        row = rows[j]
        n = i64[row * I64_PER_ROW + STATE][TREE_SIZE]
        if n < 0 or ks[j] <= 0:
            continue
        tokens, parents, _, scores = tree_views(i32[row * I32_PER_ROW + TREE], n)
        if reach_at[j] >= 0:
            scores = reach[reach_at[j] : reach_at[j] + n]
        first = at[0]
        _stops(tokens, parents, scores, ks[j], path_tokens, kid_tokens, path_end, kid_end, at)
        owner[first : at[0]] = j
    return owner, path_tokens, path_end, kid_tokens, kid_end


@njit(cache=True, nogil=True)
def subtree_nodes(tokens: np.ndarray, parents: np.ndarray, token: int) -> tuple[bool, np.ndarray, np.ndarray]:
    """Whether the tree has a root child ``token``; the nodes below the first one (parents
    precede children) and their parents re-rooted there (-1: a child of that node)."""
    n = tokens.size
    root = -1
    for i in range(n):
        if parents[i] == -1 and tokens[i] == token:
            root = i
            break
    if root < 0:
        return False, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    remap = np.full(n, -1, dtype=np.int64)  # new index of each kept node
    idx = np.empty(n, dtype=np.int64)
    new_parents = np.empty(n, dtype=np.int32)
    m = 0
    for i in range(root + 1, n):
        p = parents[i]
        if p == root or (p >= 0 and remap[p] >= 0):
            remap[i] = m
            idx[m] = i
            new_parents[m] = -1 if p == root else remap[p]
            m += 1
    return True, idx[:m], new_parents[:m]

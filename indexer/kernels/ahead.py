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


@njit(cache=True, nogil=True)
def chain_outcomes(
    owner: np.ndarray,
    chances: np.ndarray,
    keep: np.ndarray,
    path_tokens: np.ndarray,
    path_ends: np.ndarray,
    tokens: np.ndarray,
    scores: np.ndarray,
    offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The outcomes of verifying chains that are drafted ahead for. Point ``i`` (its session
    ``owner[i]``, a session's points consecutive) is where verification ends with chance
    ``chances[i]``, after the path ``path_tokens`` ending at ``path_ends[i]``; its candidates
    for the bonus token are ``[offsets[i], offsets[i + 1])`` of ``tokens`` and ``scores``. An
    outcome's chance is its point's times the candidate's share of the point's scores (float32,
    as the scores are); a session keeps its ``keep[owner]`` likeliest (ties: the earlier point,
    then candidate), each point's best-scoring first.

    Returns ``(kept, kept_ends, suffix_tokens, suffix_ends)``: the kept candidates' indices,
    point after point (point ``i``'s ending at ``kept_ends[i]``), and each one's suffix, its
    point's path and then its token, end to end."""
    n_points = owner.size
    lo_all = offsets[0]
    total = offsets[n_points] - lo_all
    share = np.empty(total, dtype=np.float32)
    for i in range(n_points):
        lo, hi = offsets[i], offsets[i + 1]
        mass = np.float32(0.0)
        for c in range(lo, hi):
            mass += scores[c]
        mass = max(mass, np.float32(1e-12))
        chance = np.float32(chances[i])
        for c in range(lo, hi):
            share[c - lo_all] = chance * scores[c] / mass
    kept_flag = np.zeros(total, dtype=np.bool_)
    i = 0
    while i < n_points:
        e = i
        while e < n_points and owner[e] == owner[i]:
            e += 1
        lo, hi = offsets[i] - lo_all, offsets[e] - lo_all
        order = np.argsort(-share[lo:hi], kind="mergesort")
        for r in range(min(max(keep[owner[i]], 0), hi - lo)):
            kept_flag[lo + order[r]] = True
        i = e
    kept = np.empty(total, dtype=np.int64)
    kept_ends = np.empty(n_points, dtype=np.int64)
    m = 0
    n_suffix = 0
    for i in range(n_points):
        lo, hi = offsets[i], offsets[i + 1]
        first = m
        for c in range(lo, hi):
            if kept_flag[c - lo_all]:
                kept[m] = c
                m += 1
        if m - first > 1:  # best-scoring first, ties in drafted order
            sel = kept[first:m].copy()
            order = np.argsort(-scores[sel], kind="mergesort")
            for r in range(m - first):
                kept[first + r] = sel[order[r]]
        kept_ends[i] = m
        path = path_ends[i] - (path_ends[i - 1] if i else 0)
        n_suffix += (m - first) * (path + 1)
    suffix_tokens = np.empty(n_suffix, dtype=np.int32)
    suffix_ends = np.empty(m, dtype=np.int64)
    at = 0
    for i in range(n_points):
        p0 = path_ends[i - 1] if i else 0
        p1 = path_ends[i]
        for r in range(kept_ends[i - 1] if i else 0, kept_ends[i]):
            for t in range(p0, p1):
                suffix_tokens[at] = path_tokens[t]
                at += 1
            suffix_tokens[at] = tokens[kept[r]]
            at += 1
            suffix_ends[r] = at
    return kept[:m], kept_ends, suffix_tokens, suffix_ends


@njit(cache=True, nogil=True)
def chain_fans(
    kept_ends: np.ndarray,
    bonus_tokens: np.ndarray,
    bonus_sources: np.ndarray,
    bonus_scores: np.ndarray,
    tokens: np.ndarray,
    sources: np.ndarray,
    scores: np.ndarray,
    offsets: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One tree per stopping point, a fan: each of its kept candidates for the bonus token
    (``bonus_*[kept_ends[i - 1]:kept_ends[i]]`` for point ``i``) a root child, and candidate
    ``r``'s chain (``[offsets[r], offsets[r + 1])`` of ``tokens``, ``sources``, ``scores``)
    below it. Returns the fans end to end, ``(tokens, parents, sources, scores, fan_ends)``,
    each fan's parents counted from its own start."""
    m = bonus_tokens.size
    n = m + offsets[m] - offsets[0]
    out_tokens = np.empty(n, dtype=np.int32)
    out_parents = np.empty(n, dtype=np.int32)
    out_sources = np.empty(n, dtype=np.uint8)
    out_scores = np.empty(n, dtype=np.float32)
    fan_ends = np.empty(kept_ends.size, dtype=np.int64)
    at = 0
    r = 0
    for i in range(kept_ends.size):
        start = at
        while r < kept_ends[i]:
            out_tokens[at] = bonus_tokens[r]
            out_parents[at] = -1
            out_sources[at] = bonus_sources[r]
            out_scores[at] = bonus_scores[r]
            parent = at - start
            at += 1
            for c in range(offsets[r], offsets[r + 1]):  # a chain under its candidate
                out_tokens[at] = tokens[c]
                out_parents[at] = parent
                out_sources[at] = sources[c]
                out_scores[at] = scores[c]
                parent = at - start
                at += 1
            r += 1
        fan_ends[i] = at
    return out_tokens, out_parents, out_sources, out_scores, fan_ends

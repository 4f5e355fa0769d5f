"""The successor table's loops: learning a token's likely followers from the target's own top-k
(what a decoder saw at the positions it verified), and drafting rows from them.

A table row per token holds up to K followers with a weight each and a norm: every observation
decays the row (``decay``), adds 1 to the norm and, to the follower at rank r of the target's
top-k, ``rank_prob[r]``, the chance that the target's greedy choice is its r-th likeliest token
when the row was recorded; so weight / norm estimates how often the follower comes next. A new
follower takes the slot of the lightest one, if it outweighs it. Rows stay sorted by weight.
"""

from __future__ import annotations

import numpy as np
from numba import njit

ROOT_ROWS = 8  # the most successor rows under each token successor_extensions carries on


@njit(cache=True, nogil=True)
def successor_observe(
    followers: np.ndarray,
    weights: np.ndarray,
    norm: np.ndarray,
    prev: np.ndarray,
    rows: np.ndarray,
    decay: float,
    rank_prob: np.ndarray,
) -> None:
    """Observation ``i``: after token ``prev[i]`` the target's top-k was ``rows[i]`` (likeliest
    first; -1 pads). Ids outside the table are skipped."""
    vocab, k = followers.shape
    for i in range(prev.size):
        t = prev[i]
        if t < 0 or t >= vocab or rows.shape[1] == 0 or rows[i, 0] < 0:  # no row for this position
            continue
        norm[t] = norm[t] * decay + 1.0
        for s in range(k):
            weights[t, s] *= decay
        for r in range(min(rows.shape[1], rank_prob.size)):
            f = rows[i, r]
            if f < 0 or f >= vocab:
                continue
            w = rank_prob[r]
            slot = -1
            for s in range(k):
                if followers[t, s] == f:
                    slot = s
                    break
            if slot < 0:  # the lightest slot (an empty one weighs 0)
                slot = k - 1
                if weights[t, slot] >= w and followers[t, slot] >= 0:
                    continue
                followers[t, slot] = f
                weights[t, slot] = 0.0
            weights[t, slot] += w
            while slot > 0 and weights[t, slot] > weights[t, slot - 1]:  # keep the row sorted
                followers[t, slot], followers[t, slot - 1] = followers[t, slot - 1], followers[t, slot]
                weights[t, slot], weights[t, slot - 1] = weights[t, slot - 1], weights[t, slot]
                slot -= 1


@njit(cache=True, nogil=True)
def successor_rows(
    followers: np.ndarray,
    weights: np.ndarray,
    norm: np.ndarray,
    last: int,
    depth: int,
    min_prob: float,
    branch: int = 2,
    max_rows: int = 24,
) -> tuple[np.ndarray, np.ndarray]:
    """Draft rows after token ``last``, as Token Recycling's tree reads its adjacency table:
    one per follower of ``last``, each carried on through its last token's followers, at most
    ``branch`` of them at every later depth (the first continues the row, the others start rows
    of their own, ``max_rows`` in all), ``depth`` tokens at most (-1 pads), with each cell's
    probability of the whole prefix (the product of the followers' weight / norm along it). A
    row stops, and a branch is not taken, where that probability falls below ``min_prob``.

    >>> f = np.full((4, 2), -1, np.int32); w = np.zeros((4, 2)); nrm = np.ones(4)
    >>> f[0], w[0] = [1, 2], [0.6, 0.4]  # after 0: 1 (.6) or 2 (.4)
    >>> f[1], w[1] = [3, 2], [0.5, 0.5]  # after 1: 3 or 2, alike
    >>> rows, probs = successor_rows(f, w, nrm, 0, 3, 0.1)
    >>> rows.tolist(), np.round(probs[:, 1], 2).tolist()  # 1 branches at depth 2, 2 has no followers
    ([[1, 3, -1], [2, -1, -1], [1, 2, -1]], [0.3, 0.0, 0.3])
    """
    vocab, k = followers.shape
    cap = max(k, max_rows)
    rows = np.full((cap, depth), -1, dtype=np.int32)
    probs = np.zeros((cap, depth))
    if last < 0 or last >= vocab or norm[last] <= 0 or depth <= 0:
        return rows[:0], probs[:0]
    n = 0
    for s in range(k):
        f = followers[last, s]
        if f < 0:
            break
        p = weights[last, s] / norm[last]
        if p < min_prob:
            break
        rows[n, 0] = f
        probs[n, 0] = p
        n += 1
    alive = np.ones(cap, dtype=np.bool_)
    for d in range(1, depth):
        grown = n
        for r in range(grown):
            if not alive[r]:
                continue
            t = rows[r, d - 1]
            if norm[t] <= 0:
                alive[r] = False
                continue
            taken = 0
            for s in range(min(branch, k)):
                f = followers[t, s]
                if f < 0:
                    break
                p = probs[r, d - 1] * weights[t, s] / norm[t]
                if p < min_prob:
                    break
                if taken == 0:
                    rows[r, d], probs[r, d] = f, p
                elif n < cap:
                    rows[n, :d], probs[n, :d] = rows[r, :d], probs[r, :d]
                    rows[n, d], probs[n, d] = f, p
                    n += 1
                taken += 1
            if taken == 0:
                alive[r] = False
    return rows[:n], probs[:n]


@njit(cache=True, nogil=True)
def successor_extensions(
    rows: np.ndarray,
    vals: np.ndarray,
    tiers: np.ndarray,
    own_tier: int,
    followers: np.ndarray,
    weights: np.ndarray,
    norm: np.ndarray,
    min_prob: float,
    confidence: float,
    max_roots: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Successor rows under the first tokens the other tiers propose. The successor tier's own
    rows start from the followers of the context's last token; a first token only another tier
    proposed would otherwise end where that tier's rows end, though the table may know what the
    target writes after it. For each of the ``max_roots`` first tokens the other tiers value
    most (``rows`` and ``vals`` as :func:`~indexer.kernels.tree.stack_parts` lays them out,
    ``tiers`` per row; a token the successor tier's own rows start with is left to them): that
    token, then its followers as :func:`successor_rows` carries them, each added cell worth the
    token's best row value times ``confidence`` times the followers' prefix probability. The
    token's own cell is worth 0: the successor tier adds nothing to what the others proposed.

    >>> f = np.full((10, 2), -1, np.int32); w = np.zeros((10, 2)); nrm = np.zeros(10)
    >>> f[3], w[3], nrm[3] = [4, 5], [0.6, 0.3], 1.0  # after 3: 4 (.6) or 5 (.3)
    >>> f[4, 0], w[4, 0], nrm[4] = 6, 0.9, 1.0  # after 4: 6 (.9)
    >>> rows = np.array([[3, 1, -1], [2, -1, -1], [7, 8, 9]], np.int32)
    >>> vals = np.array([[0.5, 0.4, 0.0], [0.2, 0.0, 0.0], [0.6, 0.5, 0.4]])
    >>> tiers = np.array([1, 1, 7])  # two rows of tier 1 (3 and 2 first), one of the successor tier (7)
    >>> ext, worth = successor_extensions(rows, vals, tiers, 7, f, w, nrm, 0.02, 0.8, 4)
    >>> ext.tolist(), np.round(worth, 3).tolist()  # 3 carried on; 2 has no followers
    ([[3, 4, 6], [3, 5, -1]], [[0.0, 0.24, 0.216], [0.0, 0.12, 0.0]])
    """
    r_count, depth = rows.shape
    if norm.size == 0 or depth < 2 or max_roots <= 0 or confidence <= 0:
        return np.full((0, depth), -1, dtype=np.int32), np.zeros((0, depth))
    cand = np.full(max_roots, -1, dtype=np.int32)
    cval = np.zeros(max_roots)
    for r in range(r_count):  # the likeliest first tokens, each at its best row's value
        t = rows[r, 0]
        if t < 0 or tiers[r] == own_tier:
            continue
        v = vals[r, 0]
        slot = -1
        for s in range(max_roots):
            if cand[s] == t:
                slot = s
                break
        if slot >= 0:
            cval[slot] = max(cval[slot], v)
            continue
        low = 0
        for s in range(1, max_roots):
            if cval[s] < cval[low]:
                low = s
        if cand[low] < 0 or v > cval[low]:
            cand[low], cval[low] = t, v
    for r in range(r_count):  # the successor tier's own rows carry these on already
        if tiers[r] == own_tier:
            for s in range(max_roots):
                if cand[s] == rows[r, 0]:
                    cand[s] = -1
    cap = max(followers.shape[1], ROOT_ROWS)  # the most rows successor_rows gives under one token
    out_rows = np.full((max_roots * cap, depth), -1, dtype=np.int32)
    out_vals = np.zeros((max_roots * cap, depth))
    n = 0
    for s in range(max_roots):
        c = cand[s]
        base = cval[s] * confidence
        if c < 0 or c >= norm.size or norm[c] <= 0 or base < min_prob:
            continue
        srows, sprobs = successor_rows(followers, weights, norm, c, depth - 1, min_prob / base, 2, ROOT_ROWS)
        k = srows.shape[0]
        out_rows[n : n + k, 0] = c
        out_rows[n : n + k, 1:] = srows
        out_vals[n : n + k, 1:] = sprobs * base
        n += k
    return out_rows[:n], out_vals[:n]

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

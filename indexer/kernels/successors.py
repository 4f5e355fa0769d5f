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
    followers: np.ndarray, weights: np.ndarray, norm: np.ndarray, last: int, depth: int, min_prob: float
) -> tuple[np.ndarray, np.ndarray]:
    """Draft rows after token ``last``: one per follower of it, each carried on through every
    token's likeliest follower, ``depth`` tokens at most (-1 pads), with each cell's probability
    of the whole prefix (the product of the followers' weight / norm along it). A row stops
    where that probability falls below ``min_prob``."""
    vocab, k = followers.shape
    rows = np.full((k, depth), -1, dtype=np.int32)
    probs = np.zeros((k, depth))
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
        t = f
        for d in range(1, depth):
            if norm[t] <= 0 or followers[t, 0] < 0:
                break
            p *= weights[t, 0] / norm[t]
            if p < min_prob:
                break
            t = followers[t, 0]
            rows[n, d] = t
            probs[n, d] = p
        n += 1
    return rows[:n], probs[:n]

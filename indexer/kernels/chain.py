"""Chain mode's per-draft work, compiled: the calibrated acceptance probability of every node,
the dynamic programme that picks the chain, and the calibrator's update from an outcome
(:mod:`indexer.chain` holds the model; these are its loops). A tree is in wire order: a parent
precedes its children."""

from __future__ import annotations

import numpy as np
from numba import njit

RATIO_BINS = 9  # score / parent score in eighths, 1.0 in a bin of its own
# A node's depth, binned: 1, 2, 3, 4-5, 6-8, 9-12, 13 or more. Deep nodes of one score and
# ratio are accepted less often than shallow ones (a long chain drifts from the text it copies).
DEPTH_EDGES = np.array([1, 2, 3, 4, 6, 9, 13])
DEPTHS = DEPTH_EDGES.size
TRACKS = 4  # how far the session's previous tree was followed: 0, 1, 2-3, 4 or more tokens
RANKS = 2  # the best-scoring child of its parent (the one a chain takes), or another


@njit(cache=True, nogil=True)
def chain_cells(
    parents: np.ndarray, scores: np.ndarray, sources: np.ndarray, score_edges: np.ndarray, track: int
) -> np.ndarray:
    """Per node its calibration cell: (ratio bin, score bin, tier, depth bin, the session's
    track-record bin ``track``, sibling rank), as an (n, 6) table. The rank tells the child a
    chain follows (its parent's best-scoring, ties to the earlier) from the alternatives beside
    it: a cell's rate over both would under-claim the one chosen."""
    n = parents.size
    cells = np.zeros((n, 6), dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    best = np.full(n + 1, -1, dtype=np.int64)  # per parent (root at n), its best child so far
    for i in range(n):
        p = parents[i] if parents[i] >= 0 else n
        if best[p] < 0 or scores[i] > scores[best[p]]:
            best[p] = i
    for i in range(n):
        p = parents[i]
        s = np.float64(scores[i])
        above = 1.0 if p < 0 else np.float64(scores[p])
        ratio = min(max(s / max(above, 1e-9), 0.0), 1.0)
        cells[i, 0] = min(int(ratio * 8), RATIO_BINS - 1)
        b = 0  # edges at or below the score
        while b < score_edges.size and score_edges[b] <= s:
            b += 1
        cells[i, 1] = b
        cells[i, 2] = sources[i]
        depth[i] = 1 if p < 0 else depth[p] + 1
        d = 0
        while d + 1 < DEPTHS and DEPTH_EDGES[d + 1] <= depth[i]:
            d += 1
        cells[i, 3] = d
        cells[i, 4] = track
        cells[i, 5] = 0 if best[p if p >= 0 else n] == i else 1
    return cells


@njit(cache=True, nogil=True)
def chain_conditional(
    cells: np.ndarray,
    hits: np.ndarray,
    trials: np.ndarray,
    coarse: np.ndarray,
    fine_prior: float,
) -> np.ndarray:
    """Per node the probability it is accepted once its parent was: the cell's rate, shrunk
    toward its (ratio bin, track record)'s (``coarse``) by ``fine_prior`` pseudo-trials."""
    n = cells.shape[0]
    out = np.empty(n)
    for i in range(n):
        r, s, t, d, k, b = cells[i, 0], cells[i, 1], cells[i, 2], cells[i, 3], cells[i, 4], cells[i, 5]
        out[i] = (hits[r, s, t, d, k, b] + fine_prior * coarse[r, k]) / (trials[r, s, t, d, k, b] + fine_prior)
    return out


@njit(cache=True, nogil=True)
def chain_reach(parents: np.ndarray, conditional: np.ndarray) -> np.ndarray:
    """Per node, the probability that verification accepts it: the product of the conditional
    probabilities along its path (parents precede children)."""
    out = conditional.astype(np.float64)
    for i in range(parents.size):
        if parents[i] >= 0:
            out[i] *= out[parents[i]]
    return out


@njit(cache=True, nogil=True)
def chain_path(
    parents: np.ndarray, conditional: np.ndarray, preference: np.ndarray, k: int, min_prob: float
) -> np.ndarray:
    """Node indices of the root path of at most ``k`` nodes with the largest sum of cumulative
    ``preference`` (the products along the path), over nodes whose cumulative ``conditional`` is
    at least ``min_prob`` (above 0 when ``min_prob`` is 0). Ties go to the earlier node."""
    n = parents.size
    if n == 0 or k <= 0:
        return np.zeros(0, dtype=np.int64)
    reach = chain_reach(parents, conditional)
    gain = chain_reach(parents, preference)
    usable = np.empty(n, dtype=np.bool_)
    for i in range(n):
        usable[i] = reach[i] >= min_prob if min_prob > 0 else reach[i] > 0
    # value[j, i]: the best sum of a path of at most j nodes starting at node i.
    value = np.zeros((k + 1, n))
    below = np.empty(n)
    for j in range(1, k + 1):
        below[:] = 0.0
        for c in range(n):
            p = parents[c]
            if p >= 0 and usable[c] and value[j - 1, c] > below[p]:
                below[p] = value[j - 1, c]
        for i in range(n):
            value[j, i] = gain[i] + below[i] if usable[i] else 0.0
    path = np.empty(k, dtype=np.int64)
    size = 0
    parent = -1
    for j in range(k, 0, -1):
        best = -1
        for c in range(n):
            if parents[c] == parent and usable[c] and (best < 0 or value[j, c] > value[j, best]):
                best = c
        if best < 0:
            break
        path[size] = best
        size += 1
        parent = best
    return path[:size]


@njit(cache=True, nogil=True)
def chain_outcome(
    parents: np.ndarray,
    tokens: np.ndarray,
    produced: np.ndarray,
    cells: np.ndarray,
    hits: np.ndarray,
    trials: np.ndarray,
    coarse_hits: np.ndarray,
    coarse_trials: np.ndarray,
) -> int:
    """Count a tree's outcome: every node whose parent matched the ``produced`` tokens (the
    accepted ones plus the bonus token) and whose depth they reach is a trial of its cell, a
    hit where its token is the one produced there. Returns how deep the tree was followed:
    the longest matched path."""
    n = parents.size
    matched = np.zeros(n, dtype=np.bool_)
    depth = np.zeros(n, dtype=np.int64)
    followed = 0
    for i in range(n):
        p = parents[i]
        depth[i] = 1 if p < 0 else depth[p] + 1
        if (p < 0 or matched[p]) and depth[i] <= produced.size:
            matched[i] = tokens[i] == produced[depth[i] - 1]
            hit = 1.0 if matched[i] else 0.0
            r, s, t, d, k, b = cells[i, 0], cells[i, 1], cells[i, 2], cells[i, 3], cells[i, 4], cells[i, 5]
            trials[r, s, t, d, k, b] += 1.0
            hits[r, s, t, d, k, b] += hit
            coarse_trials[r, k] += 1.0
            coarse_hits[r, k] += hit
            if matched[i]:
                followed = max(followed, depth[i])
    return followed

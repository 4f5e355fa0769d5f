"""Chain mode's per-draft work, compiled: the calibrated acceptance probability of every node,
the dynamic programme that picks the chain, and the calibrator's update from an outcome
(:mod:`indexer.chain` holds the model; these are its loops). A tree is in wire order: a parent
precedes its children."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from indexer.kernels.store import I32_PER_ROW, I64_PER_ROW, STATE, TREE, TREE_SIZE, tree_views

RATIO_BINS = 9  # score / parent score in eighths, 1.0 in a bin of its own
# A node's depth, binned: 1, 2, 3, 4-5, 6-8, 9-12, 13 or more. Deep nodes of one score and
# ratio are accepted less often than shallow ones (a long chain drifts from the text it copies).
DEPTH_EDGES = np.array([1, 2, 3, 4, 6, 9, 13])
DEPTHS = DEPTH_EDGES.size
# How far the session's previous tree was followed, binned: 0, 1, 2-3, 4-7, 8-15, 16 or more tokens.
TRACK_EDGES = (0, 1, 2, 4, 8, 16)
TRACKS = len(TRACK_EDGES)
RANKS = 2  # the best-scoring child of its parent (the one a chain takes), or another


@njit(cache=True, nogil=True, inline="always")
def depth_bin(depth: int) -> int:
    """The bin of :data:`DEPTH_EDGES` a node ``depth`` levels deep (from 1) falls in."""
    d = 0
    while d + 1 < DEPTHS and DEPTH_EDGES[d + 1] <= depth:
        d += 1
    return d


@njit(cache=True, nogil=True, inline="always")
def node_cell(
    score: float, above: float, source: int, depth: int, track: int, rank: int, score_edges: np.ndarray
) -> tuple[int, int, int, int, int, int]:
    """The calibration cell of a node scoring ``score`` under a parent scoring ``above`` (1 for
    a root child), of tier ``source``, ``depth`` levels deep (from 1), for a session of track
    record bin ``track``, its parent's best-scoring child (``rank`` 0) or another (1)."""
    ratio = min(max(score / max(above, 1e-9), 0.0), 1.0)
    b = 0  # edges at or below the score
    while b < score_edges.size and score_edges[b] <= score:
        b += 1
    return min(int(ratio * 8), RATIO_BINS - 1), b, source, depth_bin(depth), track, rank


@njit(cache=True, nogil=True, inline="always")
def cell_rate(
    r: int,
    s: int,
    t: int,
    d: int,
    k: int,
    b: int,
    hits: np.ndarray,
    trials: np.ndarray,
    coarse: np.ndarray,
    fine_prior: float,
) -> float:
    """A cell's acceptance rate: its own, shrunk toward its (ratio bin, track record)'s
    (``coarse``) by ``fine_prior`` pseudo-trials."""
    return (hits[r, s, t, d, k, b] + fine_prior * coarse[r, k]) / (trials[r, s, t, d, k, b] + fine_prior)


@njit(cache=True, nogil=True)
def chain_cells(
    parents: np.ndarray, scores: np.ndarray, sources: np.ndarray, score_edges: np.ndarray, track: int
) -> np.ndarray:
    """Per node its calibration cell (:func:`node_cell`: ratio bin, score bin, tier, depth bin,
    the session's track-record bin ``track``, sibling rank), as an (n, 6) table. The rank tells
    the child a chain follows (its parent's best-scoring, ties to the earlier) from the
    alternatives beside it: a cell's rate over both would under-claim the one chosen."""
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
        above = 1.0 if p < 0 else np.float64(scores[p])
        depth[i] = 1 if p < 0 else depth[p] + 1
        rank = 0 if best[p if p >= 0 else n] == i else 1
        r, s, t, d, k, b = node_cell(np.float64(scores[i]), above, sources[i], depth[i], track, rank, score_edges)
        cells[i, 0], cells[i, 1], cells[i, 2], cells[i, 3], cells[i, 4], cells[i, 5] = r, s, t, d, k, b
    return cells


@njit(cache=True, nogil=True)
def chain_conditional(
    cells: np.ndarray,
    hits: np.ndarray,
    trials: np.ndarray,
    coarse: np.ndarray,
    fine_prior: float,
) -> np.ndarray:
    """Per node the probability it is accepted once its parent was: its cell's
    :func:`cell_rate`."""
    n = cells.shape[0]
    out = np.empty(n)
    for i in range(n):
        out[i] = cell_rate(
            cells[i, 0], cells[i, 1], cells[i, 2], cells[i, 3], cells[i, 4], cells[i, 5], hits, trials, coarse,
            fine_prior,
        )  # fmt: skip
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


@njit(cache=True, nogil=True)
def chain_outcome_rows(
    i32: Any,
    i64: Any,
    rows: np.ndarray,
    produced: np.ndarray,
    ends: np.ndarray,
    tracks: np.ndarray,
    score_edges: np.ndarray,
    hits: np.ndarray,
    trials: np.ndarray,
    coarse_hits: np.ndarray,
    coarse_trials: np.ndarray,
) -> np.ndarray:
    """:func:`chain_outcome` of the tree each session in store row ``rows[j]`` holds, drafted
    for its track record ``tracks[j]`` (< 0: skipped), against the tokens produced after it
    (``produced`` between ``ends[j]`` and ``ends[j + 1]``), all in one call. Returns how deep each
    tree was followed (0 where a session holds no tree, was skipped or nothing was produced)."""
    followed = np.zeros(rows.size, dtype=np.int64)
    for j in range(rows.size):
        r = rows[j]
        n = i64[r * I64_PER_ROW + STATE][TREE_SIZE]
        new = produced[ends[j] : ends[j + 1]]
        if n <= 0 or new.size == 0 or tracks[j] < 0:
            continue
        tokens, parents, sources, scores = tree_views(i32[r * I32_PER_ROW + TREE], n)
        cells = chain_cells(parents, scores, sources, score_edges, tracks[j])
        followed[j] = chain_outcome(parents, tokens, new, cells, hits, trials, coarse_hits, coarse_trials)
    return followed


@njit(cache=True, nogil=True)
def chain_reach_outcome(
    tokens: np.ndarray,
    claims: np.ndarray,
    produced: np.ndarray,
    reach_hits: np.ndarray,
    reach_claims: np.ndarray,
    reach_edges: np.ndarray,
) -> None:
    """Count a cut chain's outcome (its ``tokens`` and raw ``claims``, the ``produced`` tokens
    after it) into one track record's (depth bin, claim bin) cells: each node's claim where it
    is known whether the target reached it, a hit where it did. A node is reached while the
    chain matches the produced tokens; past the first mismatch every node is known unreached;
    where every produced token matched (the chain went on past what was verified) the rest are
    not counted."""
    n = min(tokens.size, claims.size)
    if n == 0 or produced.size == 0:
        return
    m = min(n, produced.size)
    matched = 0
    while matched < m and tokens[matched] == produced[matched]:
        matched += 1
    known = n if matched < produced.size else matched
    for i in range(known):
        d = depth_bin(i + 1)
        b = np.searchsorted(reach_edges, claims[i], side="right")
        reach_claims[d, b] += claims[i]
        if i < matched:
            reach_hits[d, b] += 1.0


@njit(cache=True, nogil=True)
def chain_backoff(coarse_hits: np.ndarray, coarse_trials: np.ndarray, claim: np.ndarray, prior: float) -> np.ndarray:
    """The (ratio bin, track record) rates a fine cell backs off to: each shrunk by ``prior``
    pseudo-trials toward its ratio bin's rate over every track record, that toward the bin's
    own ``claim``."""
    out = np.empty_like(coarse_hits)
    for r in range(coarse_hits.shape[0]):
        hits, trials = 0.0, 0.0
        for k in range(coarse_hits.shape[1]):
            hits += coarse_hits[r, k]
            trials += coarse_trials[r, k]
        ratio = (hits + prior * claim[r]) / (trials + prior)
        for k in range(coarse_hits.shape[1]):
            out[r, k] = (coarse_hits[r, k] + prior * ratio) / (coarse_trials[r, k] + prior)
    return out


@njit(cache=True, nogil=True)
def chain_pick(
    parents: np.ndarray,
    scores: np.ndarray,
    sources: np.ndarray,
    score_edges: np.ndarray,
    track: int,
    hits: np.ndarray,
    trials: np.ndarray,
    coarse: np.ndarray,
    fine_prior: float,
    k: int,
    min_prob: float,
    reach_hits: np.ndarray,
    reach_claims: np.ndarray,
    reach_edges: np.ndarray,
    reach_prior: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tree's chain in one pass: every node's conditional (:func:`chain_cells`,
    :func:`chain_conditional`), the path (:func:`chain_path`, ranked by the conditionals times
    the scores), its claims (the cumulative conditionals) and its reach: each claim scaled by
    its (depth, claim) cell of ``reach_hits`` / ``reach_claims`` (the track record's), shrunk
    toward 1 by ``reach_prior`` pseudo-trials, never rising along the chain, the chain ended
    where that falls below ``min_prob`` (at 0: where it is 0). Returns (node indices, claims,
    reach)."""
    cells = chain_cells(parents, scores, sources, score_edges, track)
    conditional = chain_conditional(cells, hits, trials, coarse, fine_prior)
    preference = conditional * scores.astype(np.float64)
    path = chain_path(parents, conditional, preference, k, min_prob)
    m = path.size
    claims = np.empty(m)
    reach = np.empty(m)
    keep = 0
    claim, lowest = 1.0, 1.0
    for i in range(m):
        claim *= conditional[path[i]]
        claims[i] = claim
        d = depth_bin(i + 1)
        b = np.searchsorted(reach_edges, claim, side="right")
        scaled = min(1.0, claim * (reach_hits[d, b] + reach_prior) / (reach_claims[d, b] + reach_prior))
        lowest = min(lowest, scaled)
        reach[i] = lowest
        if (lowest >= min_prob) if min_prob > 0 else (lowest > 0):
            keep = i + 1
    return path[:keep], claims[:keep], reach[:keep]


@njit(cache=True, nogil=True)
def chain_batch(
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    scores: np.ndarray,
    offsets: np.ndarray,
    ks: np.ndarray,
    min_probs: np.ndarray,
    tracks: np.ndarray,
    score_edges: np.ndarray,
    hits: np.ndarray,
    trials: np.ndarray,
    coarse: np.ndarray,
    fine_prior: float,
    reach_hits: np.ndarray,
    reach_claims: np.ndarray,
    reach_edges: np.ndarray,
    reach_prior: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`chain_pick` for every tree of a batch (tree ``j`` is ``[offsets[j],
    offsets[j + 1])``, its chain at most ``ks[j]`` long, cut at ``min_probs[j]``, for a session
    of track record ``tracks[j]``; ``reach_hits`` / ``reach_claims`` by track record first).
    Returns the chains as a batch (tokens, parents, sources, reach as scores, offsets) and
    their claims, laid out as the chains are."""
    trees = offsets.size - 1
    total = 0
    for j in range(trees):
        total += min(ks[j], offsets[j + 1] - offsets[j])
    out_tokens = np.empty(total, dtype=np.int32)
    out_parents = np.empty(total, dtype=np.int32)
    out_sources = np.empty(total, dtype=np.uint8)
    out_scores = np.empty(total, dtype=np.float32)
    out_claims = np.empty(total)
    out_offsets = np.zeros(trees + 1, dtype=np.int64)
    at = 0
    for j in range(trees):
        lo, hi = offsets[j], offsets[j + 1]
        if hi > lo:
            t = tracks[j]
            path, claims, reach = chain_pick(
                parents[lo:hi], scores[lo:hi], sources[lo:hi], score_edges, t, hits, trials, coarse, fine_prior,
                ks[j], min_probs[j], reach_hits[t], reach_claims[t], reach_edges, reach_prior,
            )  # fmt: skip
            for i in range(path.size):
                out_tokens[at + i] = tokens[lo + path[i]]
                out_parents[at + i] = i - 1
                out_sources[at + i] = sources[lo + path[i]]
                out_scores[at + i] = reach[i]
                out_claims[at + i] = claims[i]
            at += path.size
        out_offsets[j + 1] = at
    return out_tokens[:at], out_parents[:at], out_sources[:at], out_scores[:at], out_offsets, out_claims[:at]

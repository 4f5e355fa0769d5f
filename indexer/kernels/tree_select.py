"""Trees kept by their calibrated chances, compiled: from a tree drafted larger than its budget
(the pool), the budget's nodes most likely to be accepted.

The merge ranks nodes by their scores, which sum the tiers' votes and cap at 1: not
probabilities (nodes scoring 0.4-0.5 were accepted 4% of the time, nodes at the cap 35%). The
chain calibrator (:mod:`indexer.chain`) learns, per cell of (ratio to the parent's score, score,
tier, depth, the session's track record, sibling rank), how often the target accepts a node
whose parent it accepted. A tree's expected accepted length is the sum over its nodes of the
chance verification reaches them (the products of those conditionals along their paths), so
the nodes with the largest reach are the tree of that size to verify. A node's reach never
exceeds its parent's, so the kept nodes form a tree: ranked by reach, ties to the earlier node,
a parent always comes before its children.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from indexer.kernels.chain import TRACKS, chain_backoff, chain_cells, chain_conditional, chain_reach
from indexer.kernels.draft import draft_batch
from indexer.kernels.store import I32_PER_ROW, I64_PER_ROW, STATE, TREE, write_tree


@njit(cache=True, nogil=True)
def keep_likeliest(parents: np.ndarray, reach: np.ndarray, budget: int) -> np.ndarray:
    """Indices (ascending: wire order kept) of at most ``budget`` nodes with the largest
    ``reach``, ties to the earlier node, each one's parent among them.

    >>> keep_likeliest(np.array([-1, 0, -1, 2]), np.array([0.5, 0.1, 0.4, 0.3]), 3).tolist()
    [0, 2, 3]
    """
    n = parents.size
    if n <= budget:
        return np.arange(n)
    order = np.argsort(-reach, kind="mergesort")  # stable: ties to the earlier node
    kept = np.zeros(n, dtype=np.bool_)
    count = 0
    for i in order:
        if count == budget:
            break
        if parents[i] < 0 or kept[parents[i]]:  # never a node whose parent was left out
            kept[i] = True
            count += 1
    return np.flatnonzero(kept)


@njit(cache=True, nogil=True)
def select_batch(
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    scores: np.ndarray,
    offsets: np.ndarray,
    budgets: np.ndarray,
    tracks: np.ndarray,
    rows: np.ndarray,
    i32: Any,
    i64: Any,
    score_edges: np.ndarray,
    cell_hits: np.ndarray,
    cell_trials: np.ndarray,
    coarse_hits: np.ndarray,
    coarse_trials: np.ndarray,
    claim: np.ndarray,
    coarse_prior: float,
    fine_prior: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tree ``j`` of a batch (``[offsets[j], offsets[j + 1])``) cut to the ``budgets[j]`` nodes
    verification most likely reaches, for a session of track record ``tracks[j]`` (a negative
    budget: kept whole). The session in store row ``rows[j]`` (< 0: none) holds the tree kept,
    in place of the one drafted. The calibration as
    :func:`~indexer.kernels.draft_chain.draft_chain_batch` takes it. Returns the trees end to
    end, their nodes' scores as drafted."""
    trees = offsets.size - 1
    coarse = chain_backoff(coarse_hits, coarse_trials, claim, coarse_prior)
    out_tokens = np.empty(tokens.size, dtype=np.int32)
    out_parents = np.empty(tokens.size, dtype=np.int32)
    out_sources = np.empty(tokens.size, dtype=np.uint8)
    out_scores = np.empty(tokens.size, dtype=np.float32)
    out_offsets = np.zeros(trees + 1, dtype=np.int64)
    at = 0
    for j in range(trees):
        lo, hi = offsets[j], offsets[j + 1]
        n = hi - lo
        if budgets[j] < 0 or n <= budgets[j]:
            idx = np.arange(n)
        else:
            track = min(max(tracks[j], 0), TRACKS - 1)
            cells = chain_cells(parents[lo:hi], scores[lo:hi], sources[lo:hi], score_edges, track)
            reach = chain_reach(parents[lo:hi], chain_conditional(cells, cell_hits, cell_trials, coarse, fine_prior))
            idx = keep_likeliest(parents[lo:hi], reach, budgets[j])
        where = np.full(n, -1, dtype=np.int32)
        for i in range(idx.size):
            where[idx[i]] = i
        for i in range(idx.size):
            src = lo + idx[i]
            out_tokens[at + i] = tokens[src]
            out_parents[at + i] = where[parents[src]] if parents[src] >= 0 else -1
            out_sources[at + i] = sources[src]
            out_scores[at + i] = scores[src]
        if rows[j] >= 0 and idx.size < n:  # fits: the buffer held the larger tree
            r = rows[j]
            write_tree(
                i32[r * I32_PER_ROW + TREE], i64[r * I64_PER_ROW + STATE], out_tokens[at : at + idx.size],
                out_parents[at : at + idx.size], out_sources[at : at + idx.size], out_scores[at : at + idx.size],
            )  # fmt: skip
        at += idx.size
        out_offsets[j + 1] = at
    return out_tokens[:at], out_parents[:at], out_sources[:at], out_scores[:at], out_offsets


@njit(cache=True, nogil=True)
def draft_select_batch(
    jobs: np.ndarray,
    min_score: np.ndarray,
    suffix: np.ndarray,
    exclude: np.ndarray,
    prior_orders: np.ndarray,
    prior_keys: np.ndarray,
    prior_owner: np.ndarray,
    prior_slot: np.ndarray,
    prior_offsets: Any,
    prior_followers: Any,
    prior_probs: Any,
    i32: Any,
    i64: Any,
    main_tokens: np.ndarray,
    main_sa: np.ndarray,
    run_tokens: np.ndarray,
    run_sa: np.ndarray,
    run_offsets: np.ndarray,
    table_keys: np.ndarray,
    table_offsets: np.ndarray,
    table_followers: np.ndarray,
    table_probs: np.ndarray,
    table_ll: int,
    main_serial: int,
    succ_followers: np.ndarray,
    succ_weights: np.ndarray,
    succ_norm: np.ndarray,
    settings: np.ndarray,
    half: np.ndarray,
    hits: np.ndarray,
    pred: np.ndarray,
    budgets: np.ndarray,
    tracks: np.ndarray,
    rows: np.ndarray,
    score_edges: np.ndarray,
    cell_hits: np.ndarray,
    cell_trials: np.ndarray,
    coarse_hits: np.ndarray,
    coarse_trials: np.ndarray,
    claim: np.ndarray,
    coarse_prior: float,
    fine_prior: float,
) -> tuple:
    """:func:`~indexer.kernels.draft.draft_batch` over the first 31 arguments (the jobs'
    budgets their pools), then :func:`select_batch` over its trees in the same call: one trip
    into compiled code a draft, as :func:`~indexer.kernels.draft_chain.draft_chain_batch` makes
    for chains. Returns the trees kept end to end ``(tokens, parents, sources, scores,
    offsets)`` and per job whether its session's tree buffer had to grow."""
    tokens, parents, sources, scores, offsets, _, _, _, grown = draft_batch(
        jobs, min_score, suffix, exclude, prior_orders, prior_keys, prior_owner, prior_slot, prior_offsets,
        prior_followers, prior_probs, i32, i64, main_tokens, main_sa, run_tokens, run_sa, run_offsets, table_keys,
        table_offsets, table_followers, table_probs, table_ll, main_serial, succ_followers, succ_weights, succ_norm,
        settings, half, hits, pred,
    )  # fmt: skip
    k_tokens, k_parents, k_sources, k_scores, k_offsets = select_batch(
        tokens, parents, sources, scores, offsets, budgets, tracks, rows, i32, i64, score_edges, cell_hits,
        cell_trials, coarse_hits, coarse_trials, claim, coarse_prior, fine_prior,
    )  # fmt: skip
    return k_tokens, k_parents, k_sources, k_scores, k_offsets, grown

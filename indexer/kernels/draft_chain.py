"""Chain mode's draft step as one compiled call: each job's tree drafted
(:func:`~indexer.kernels.draft.draft_batch`) and cut to the chain an engine verifies
(:func:`~indexer.kernels.chain.chain_batch`), the calibration's back-off rates worked out on
the way.

Drafted apart, a chain paid for two trips into compiled code and the Python between them
(the trees wrapped, the calibrator's arguments gathered, the back-off recomputed after every
outcome): about as much again as the chain's own work, on every step of every request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from indexer.kernels.chain import TRACKS, chain_backoff, chain_batch
from indexer.kernels.draft import draft_batch


@njit(cache=True, nogil=True)
def draft_chain_batch(
    jobs: np.ndarray,
    min_score: np.ndarray,
    suffix: np.ndarray,
    exclude: np.ndarray,
    prior_orders: np.ndarray,
    prior_keys: np.ndarray,
    prior_owner: np.ndarray,
    prior_slot: np.ndarray,
    prior_tables: Any,
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
    score_edges: np.ndarray,
    cell_hits: np.ndarray,
    cell_trials: np.ndarray,
    coarse_hits: np.ndarray,
    coarse_trials: np.ndarray,
    claim: np.ndarray,
    coarse_prior: float,
    fine_prior: float,
    ks: np.ndarray,
    min_probs: np.ndarray,
    tracks: np.ndarray,
    reach_hits: np.ndarray,
    reach_claims: np.ndarray,
    reach_edges: np.ndarray,
    reach_prior: float,
) -> tuple:
    """:func:`~indexer.kernels.draft.draft_batch` over the first 37 arguments (each job's
    session keeps its whole tree, as there), then each tree cut as
    :func:`~indexer.kernels.chain.chain_batch` cuts it: job ``j``'s chain at most ``ks[j]``
    tokens, ended at ``min_probs[j]``, for a session of track record ``tracks[j]`` (clamped to
    the records there are). The calibration: per fine cell ``cell_hits`` / ``cell_trials``,
    backed off to the (ratio bin, track record) rates :func:`~indexer.kernels.chain.chain_backoff`
    makes of ``coarse_hits``, ``coarse_trials`` and the ratio bins' ``claim``; the reach by
    track record, depth and claim.

    Returns the chains end to end ``(tokens, parents, sources, reach as scores, offsets)``,
    their nodes' raw claims laid out as the chains are, and per job whether its session's tree
    buffer had to grow (as :func:`~indexer.kernels.draft.draft_batch` returns it)."""
    tokens, parents, sources, scores, offsets, grown = draft_batch(
        jobs, min_score, suffix, exclude, prior_orders, prior_keys, prior_owner, prior_slot, prior_tables,
        i32, i64, main_tokens, main_sa, run_tokens, run_sa, run_offsets, table_keys,
        table_offsets, table_followers, table_probs, table_ll, main_serial, succ_followers, succ_weights, succ_norm,
        settings, half, hits, pred, score_edges, cell_hits, cell_trials, coarse_hits, coarse_trials, claim,
        coarse_prior, fine_prior,
    )  # fmt: skip
    coarse = chain_backoff(coarse_hits, coarse_trials, claim, coarse_prior)
    records = np.empty(tracks.size, dtype=np.int64)
    for j in range(tracks.size):
        records[j] = min(max(tracks[j], 0), TRACKS - 1)
    c_tokens, c_parents, c_sources, c_scores, c_offsets, claims = chain_batch(
        tokens, parents, sources, scores, offsets, ks, min_probs, records, score_edges, cell_hits, cell_trials,
        coarse, fine_prior, reach_hits, reach_claims, reach_edges, reach_prior,
    )  # fmt: skip
    return c_tokens, c_parents, c_sources, c_scores, c_offsets, claims, grown

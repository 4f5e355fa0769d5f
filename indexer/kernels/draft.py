"""A batch's draft step in one compiled call: every tier searched for every sequence, each
tier's confidence computed, the trees merged.

The tiers that need the sequence's own state kept in Python (the rejected table, the static
prior, the exact-prompt cache) are found beforehand and come in as ready parts; the rest (own
context, dynamic followers, lifetime suffix indexes and frozen table) are searched here, so a
sequence costs no interpreter work between its first search and its merged tree.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from indexer.kernels.search import context_continuations, context_followers, stacked_continuations
from indexer.kernels.tables import find_leader
from indexer.kernels.tree import merge_tree, stack_parts, tree_buffers

# Tier values (indexer.tree_builder.Tier; a test keeps the two equal).
DYNAMIC, CONTEXT, REJECTED, LIFETIME_SA, LIFETIME_NGRAM = 0, 1, 2, 3, 4

# Columns of the per-sequence ``seq`` table, and the ``settings`` vector's fields.
SEQ_COLUMNS = ("ctx_start", "ctx_end", "index_start", "index_end", "indexed", "since", "context_hint",
               "lifetime_hint", "depth", "budget", "depth_reserve", "exclude_start", "exclude_end")  # fmt: skip
SETTINGS = ("max_match", "samples", "context_samples", "leader_len", "follower_len", "max_followers", "buckets",
            "stop")  # fmt: skip


@njit(cache=True, nogil=True)
def half_to_float(bits: np.ndarray) -> np.ndarray:
    """IEEE half-precision values, given as their ``uint16`` bits (2-D), as float64, exactly."""
    out = np.empty(bits.shape, dtype=np.float64)
    for r in range(bits.shape[0]):
        for c in range(bits.shape[1]):
            b = np.int64(bits[r, c])
            exp = (b >> 10) & 0x1F
            man = b & 0x3FF
            v: float
            if exp == 0:
                v = man * 2.0**-24
            elif exp == 31:
                v = np.inf if man == 0 else np.nan
            else:
                v = (1.0 + man / 1024.0) * 2.0 ** (exp - 15)
            out[r, c] = -v if b >> 15 else v
    return out


@njit(cache=True, nogil=True)
def _confidence(tier: int, n: int, half: np.ndarray, hits: np.ndarray, pred: np.ndarray, buckets: int) -> float:
    """A tier's confidence at match length ``n``: its prior ``n / (n + half)`` times its
    calibration factor (accepted + 2) / (predicted + 2) for that length's bucket, at most 1."""
    b = min(n, buckets)
    return min(1.0, (n / (n + half[tier])) * ((hits[tier, b] + 2.0) / (pred[tier, b] + 2.0)))


@njit(cache=True, nogil=True)
def _excluded(token: int, exclude: np.ndarray) -> bool:
    for e in range(exclude.size):  # noqa: SIM110 (compiled: a plain loop, no generator)
        if exclude[e] == token:
            return True
    return False


@njit(cache=True, nogil=True)
def _put(
    rows: np.ndarray,
    vals: np.ndarray,
    per_cell: bool,
    tier: int,
    conf: float,
    exclude: np.ndarray,
    rows_flat: np.ndarray,
    vals_flat: np.ndarray,
    meta: np.ndarray,
    confs: np.ndarray,
    at: np.ndarray,
) -> None:
    """Append a tier's part, without the rows starting with an excluded token, to the flat
    layout :func:`~indexer.kernels.tree.stack_parts` reads; ``at`` holds (parts, row cells,
    values) used so far. ``vals`` has a probability per cell (``per_cell``) or a weight per row
    (its one column). A part left empty is left out, as if the tier had found nothing."""
    k, w = rows.shape
    ro, vo, kept = at[1], at[2], 0
    for r in range(k):
        if w > 0 and _excluded(rows[r, 0], exclude):
            continue
        kept += 1
        for d in range(w):
            rows_flat[ro] = rows[r, d]
            ro += 1
        for d in range(w if per_cell else 1):
            vals_flat[vo] = vals[r, d]
            vo += 1
    if kept == 0:
        return
    p = at[0]
    meta[p, 0], meta[p, 1], meta[p, 2], meta[p, 3] = kept, w, 1 if per_cell else 0, tier
    confs[p] = conf
    at[0], at[1], at[2] = p + 1, ro, vo


@njit(cache=True, nogil=True)
def _extra_starts(extra_meta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each ready-made part's tokens and values start."""
    n_extra = extra_meta.shape[0]
    extra_ro = np.zeros(n_extra + 1, dtype=np.int64)
    extra_vo = np.zeros(n_extra + 1, dtype=np.int64)
    for e in range(n_extra):
        cells = extra_meta[e, 0] * extra_meta[e, 1]
        extra_ro[e + 1] = extra_ro[e] + cells
        extra_vo[e + 1] = extra_vo[e] + (cells if extra_meta[e, 2] else extra_meta[e, 0])
    return extra_ro, extra_vo


@njit(cache=True, nogil=True)
def _slots(seq: np.ndarray) -> np.ndarray:
    """Where each sequence's tree may start in the output buffers: room for its budget."""
    slot = np.zeros(seq.shape[0] + 1, dtype=np.int64)
    for j in range(seq.shape[0]):
        slot[j + 1] = slot[j] + max(0, seq[j, 9])
    return slot


@njit(cache=True, nogil=True)
def _packed(
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    scores: np.ndarray,
    slot: np.ndarray,
    sizes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The trees moved from their slots to end to end, in place (a tree only ever moves
    left), and their offsets."""
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    out = 0
    for j in range(sizes.size):
        a, k = slot[j], sizes[j]
        if a != out:
            for i in range(k):
                tokens[out + i] = tokens[a + i]
                parents[out + i] = parents[a + i]
                sources[out + i] = sources[a + i]
                scores[out + i] = scores[a + i]
        out += k
        offsets[j + 1] = out
    return tokens[:out], parents[:out], sources[:out], scores[:out], offsets


@njit(cache=True, nogil=True)
def _draft_one(j: int, args: tuple, out: tuple) -> None:
    """Sequence ``j`` of :func:`draft_batch` (``args``: its arguments; ``out``:
    :func:`_outputs`): its tree written at ``slot[j]`` (``sizes[j]`` nodes) and its rows of
    ``first_tok``, ``guess`` and ``lengths``. It writes nothing another sequence writes, so the
    sequences may be drafted in any order, or at once."""
    (
        seq, min_score, contexts, index_tokens, index_sa, exclude, extra_rows, extra_vals, extra_meta,
        extra_offsets, main_tokens, main_sa, run_tokens, run_sa, run_offsets, table_keys, table_offsets,
        table_followers, table_probs, table_ll, settings, half, hits, pred
    ) = args  # fmt: skip
    extra_ro, extra_vo, tokens, parents, sources, scores, slot, sizes, first_tok, guess, lengths = out
    n_tiers = half.size
    max_match, samples, ctx_samples = settings[0], settings[1], settings[2]
    leader_len, follower_len, max_followers = settings[3], settings[4], settings[5]
    buckets, stop = settings[6], settings[7]
    conf_of = np.zeros(n_tiers)
    at = np.zeros(3, dtype=np.int64)
    ctx = contexts[seq[j, 0] : seq[j, 1]]
    idx_tok = index_tokens[seq[j, 2] : seq[j, 3]]
    idx_sa = index_sa[seq[j, 2] : seq[j, 3]]
    indexed, since, depth, budget = seq[j, 4], seq[j, 5], seq[j, 8], seq[j, 9]
    excl = exclude[seq[j, 11] : seq[j, 12]]
    n_c, rows_c, w_c = context_continuations(
        ctx, idx_tok, idx_sa, indexed, max_match, seq[j, 6], depth, ctx_samples, stop
    )
    rows_d, w_d = context_followers(ctx, idx_tok, idx_sa, indexed, since, leader_len, follower_len, max_followers)
    best, rows_l, w_l = stacked_continuations(
        main_tokens, main_sa, run_tokens, run_sa, run_offsets, ctx, max_match, seq[j, 7], depth, samples, stop
    )
    leader = -1
    if best > 0 and table_ll > 0 and best <= table_ll:
        leader = find_leader(ctx, table_ll, table_keys)
    e0, e1 = extra_offsets[j], extra_offsets[j + 1]
    bound_r = rows_c.size + rows_d.size + rows_l.size + extra_ro[e1] - extra_ro[e0]
    if leader >= 0:
        bound_r += (table_offsets[leader + 1] - table_offsets[leader]) * table_followers.shape[1]
    rows_flat = np.empty(bound_r, dtype=np.int32)
    vals_flat = np.empty(bound_r + rows_c.shape[0] + rows_d.shape[0] + rows_l.shape[0] + e1 - e0)
    meta = np.zeros((5 + e1 - e0, 4), dtype=np.int64)
    confs = np.zeros(5 + e1 - e0)
    if n_c > 0:
        conf_of[CONTEXT] = _confidence(CONTEXT, n_c, half, hits, pred, buckets)
        lengths[j, CONTEXT] = n_c
        _put(rows_c, w_c.reshape((-1, 1)), False, CONTEXT, conf_of[CONTEXT], excl, rows_flat, vals_flat, meta,
             confs, at)  # fmt: skip
    if w_d.size:
        conf_of[DYNAMIC] = _confidence(DYNAMIC, leader_len, half, hits, pred, buckets)
        lengths[j, DYNAMIC] = leader_len
        _put(rows_d, w_d.reshape((-1, 1)), False, DYNAMIC, conf_of[DYNAMIC], excl, rows_flat, vals_flat, meta,
             confs, at)  # fmt: skip
    for before in (True, False):
        if not before:  # the lifetime tiers come after the rejected one, before the others
            if leader >= 0:
                lo, hi = table_offsets[leader], table_offsets[leader + 1]
                conf_of[LIFETIME_NGRAM] = _confidence(LIFETIME_NGRAM, table_ll, half, hits, pred, buckets)
                lengths[j, LIFETIME_NGRAM] = table_ll
                probs = half_to_float(table_probs[lo:hi])
                _put(table_followers[lo:hi], probs, True, LIFETIME_NGRAM, conf_of[LIFETIME_NGRAM], excl,
                     rows_flat, vals_flat, meta, confs, at)  # fmt: skip
            elif best > 0:
                conf_of[LIFETIME_SA] = _confidence(LIFETIME_SA, best, half, hits, pred, buckets)
                lengths[j, LIFETIME_SA] = best
                _put(rows_l, w_l.reshape((-1, 1)), False, LIFETIME_SA, conf_of[LIFETIME_SA], excl,
                     rows_flat, vals_flat, meta, confs, at)  # fmt: skip
        for e in range(e0, e1):
            tier = extra_meta[e, 3]
            if (tier == REJECTED) != before:
                continue
            k, w, per_cell, n = extra_meta[e, 0], extra_meta[e, 1], extra_meta[e, 2] != 0, extra_meta[e, 4]
            rows = extra_rows[extra_ro[e] : extra_ro[e + 1]].reshape((k, w))
            vals = extra_vals[extra_vo[e] : extra_vo[e + 1]].reshape((k, w if per_cell else 1))
            conf_of[tier] = _confidence(tier, n, half, hits, pred, buckets)
            lengths[j, tier] = n
            _put(rows, vals, per_cell, tier, conf_of[tier], excl, rows_flat, vals_flat, meta, confs, at)
    n_parts = at[0]
    if n_parts > 0 and budget > 0 and depth > 0:
        rows, vals, is_max, tiers = stack_parts(
            rows_flat[: at[1]], vals_flat[: at[2]], meta[:n_parts], confs[:n_parts], depth
        )
        tok, par, src, sc, ft, fv = merge_tree(rows, vals, is_max, tiers, n_tiers, budget, min_score[j], seq[j, 10])
        k = tok.size
        a = slot[j]
        tokens[a : a + k] = tok
        parents[a : a + k] = par
        sources[a : a + k] = src
        scores[a : a + k] = sc
        sizes[j] = k
        for t in range(n_tiers):
            if ft[t] >= 0 and conf_of[t] > 0:
                n = lengths[j, t]
                first_tok[j, t] = ft[t]
                guess[j, t] = fv[t] / conf_of[t] * (n / (n + half[t]))


@njit(cache=True, nogil=True)
def _outputs(seq: np.ndarray, extra_meta: np.ndarray, n_tiers: int) -> tuple:
    """What :func:`_draft_one` reads besides the arguments and writes: the parts' starts, each
    sequence's slot, the tree buffers, the trees' sizes and the per-tier guesses."""
    n_seq = seq.shape[0]
    extra_ro, extra_vo = _extra_starts(extra_meta)
    slot = _slots(seq)
    tokens, parents, sources, scores = tree_buffers(int(slot[n_seq]))
    sizes = np.zeros(n_seq, dtype=np.int64)
    first_tok = np.full((n_seq, n_tiers), -1, dtype=np.int64)
    guess = np.zeros((n_seq, n_tiers))
    lengths = np.zeros((n_seq, n_tiers), dtype=np.int64)
    return extra_ro, extra_vo, tokens, parents, sources, scores, slot, sizes, first_tok, guess, lengths


@njit(cache=True, nogil=True)
def _results(
    out: tuple,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`draft_batch`'s return value from the written outputs."""
    _, _, tokens, parents, sources, scores, slot, sizes, first_tok, guess, lengths = out
    tokens, parents, sources, scores, offsets = _packed(tokens, parents, sources, scores, slot, sizes)
    return tokens, parents, sources, scores, offsets, first_tok, guess, lengths


@njit(cache=True, nogil=True)
def draft_batch(
    seq: np.ndarray,
    min_score: np.ndarray,
    contexts: np.ndarray,
    index_tokens: np.ndarray,
    index_sa: np.ndarray,
    exclude: np.ndarray,
    extra_rows: np.ndarray,
    extra_vals: np.ndarray,
    extra_meta: np.ndarray,
    extra_offsets: np.ndarray,
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
    settings: np.ndarray,
    half: np.ndarray,
    hits: np.ndarray,
    pred: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Draft trees for a batch of sequences.

    Sequence ``j`` is row ``j`` of ``seq`` (columns :data:`SEQ_COLUMNS`): its context is
    ``contexts[ctx_start:ctx_end]``; its prompt's suffix index (tokens and suffix array, empty
    when the prompt is not indexed) is ``[index_start:index_end]`` of ``index_tokens`` and
    ``index_sa``, covering the context's first ``indexed`` tokens; the dynamic tier counts
    occurrences from ``since``; the hints are the last match lengths of the own-context and
    lifetime-suffix tiers (0: none); the tree takes at most ``budget`` nodes, ``depth`` levels
    and reserves ``depth_reserve`` nodes for its best chain, keeping nodes scoring above
    ``min_score[j]``; root children whose token is in ``exclude[exclude_start:exclude_end]``
    are left out. Its ready-made parts are ``extra_meta[extra_offsets[j]:extra_offsets[j + 1]]``
    (columns rows, width, per_cell, tier, match length; tokens and values end to end in
    ``extra_rows`` and ``extra_vals``), the rejected tier's placed before the lifetime tiers.

    The lifetime memory is the main suffix index and its delta runs (see
    :func:`~indexer.kernels.search.stacked_continuations`) plus the frozen table over the main
    index (``table_probs`` as float16 bits) whose leaders are ``table_ll`` tokens (0: no table).
    A lifetime match no longer than the table's leaders is answered by the table's followers
    when it holds the leader. Confidence per tier: :func:`_confidence` over ``half`` and the
    calibration counts ``hits`` and ``pred`` (tiers x buckets + 1).

    Returns the trees end to end ``(tokens, parents, sources, scores, offsets)`` and, per
    sequence and tier, ``first_token`` (-1: no first guess), the first guess's probability
    under that tier alone times the tier's prior (what calibration compares with the outcome),
    and the match length behind the tier (0: the tier found nothing).
    """
    args = (
        seq, min_score, contexts, index_tokens, index_sa, exclude, extra_rows, extra_vals, extra_meta,
        extra_offsets, main_tokens, main_sa, run_tokens, run_sa, run_offsets, table_keys, table_offsets,
        table_followers, table_probs, table_ll, settings, half, hits, pred
    )  # fmt: skip
    out = _outputs(seq, extra_meta, half.size)
    for j in range(seq.shape[0]):
        _draft_one(j, args, out)
    return _results(out)


@njit(cache=True, nogil=True, parallel=True)
def draft_batch_parallel(*args: Any) -> tuple:
    """:func:`draft_batch` (the same arguments) with the sequences shared among the compiled
    code's worker threads: the same trees, each sequence's depending on its own inputs only."""
    seq, extra_meta, half = args[0], args[8], args[21]
    out = _outputs(seq, extra_meta, half.size)
    for j in prange(seq.shape[0]):
        _draft_one(j, args, out)
    return _results(out)


@njit(cache=True, nogil=True)
def calibrate(
    hits: np.ndarray,
    pred: np.ndarray,
    first_tok: np.ndarray,
    guess: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    actual: np.ndarray,
    buckets: int,
) -> None:
    """Count first guesses against what the target produced, in place: for sequence
    ``rows[i]`` of a :func:`draft_batch` call (its ``first_tok``, ``guess`` and ``lengths``),
    each tier's guess adds its probability to ``pred`` and a hit, when it equals ``actual[i]``,
    to ``hits``, per tier and match-length bucket; row by row, tier by tier."""
    for i in range(rows.size):
        j = rows[i]
        for t in range(first_tok.shape[1]):
            if first_tok[j, t] >= 0:
                b = min(lengths[j, t], buckets)
                pred[t, b] += guess[j, t]
                hits[t, b] += first_tok[j, t] == actual[i]

"""A batch's draft step in one compiled call: every tier searched for every sequence, each
tier's confidence computed, the trees merged.

Sessions are read where their store holds them (:mod:`indexer.kernels.store`): context, prompt
index, rejected table, exact-prompt response and state, by row; the static prior's tables come
as :func:`prior_args`. So a sequence costs no interpreter work.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import njit, prange, typed, types

from indexer.kernels import lru
from indexer.kernels.arrays import read_only
from indexer.kernels.chain import chain_backoff
from indexer.kernels.search import context_continuations, context_followers, stacked_continuations
from indexer.kernels.store import (
    CTX,
    EXACT,
    EXACT_AGREES,
    FIRST_TOKEN,
    GREW_TREE,
    GUESS,
    GUESS_LENGTH,
    GUESSED,
    HINT_CTX,
    HINT_LIFE,
    I32_PER_ROW,
    I64_PER_ROW,
    INDEXED,
    LEN,
    MATCH_AT,
    MATCH_FIRST,
    MATCH_LAST,
    MATCH_LEN,
    MATCH_SERIAL,
    PROMPT_LEN,
    REJECTED_TABLE,
    SA,
    SA_TOKENS,
    STATE,
    TREE,
    write_tree,
)
from indexer.kernels.successors import successor_extensions, successor_rows
from indexer.kernels.tables import find_leader, find_longest_leader
from indexer.kernels.tree import merge_tree, stack_parts, tree_buffers

# Tier values (indexer.tree_builder.Tier; a test keeps the two equal).
DYNAMIC, CONTEXT, REJECTED, LIFETIME_SA, LIFETIME_NGRAM, PRIOR, EXACT_TIER, SUCCESSOR = 0, 1, 2, 3, 4, 5, 6, 7
SUCCESSOR_MIN_PROB = 0.02  # a successor row stops where its prefix is less likely than this
SUCCESSOR_ROOTS = 4  # the other tiers' likeliest first tokens the successor tier carries on
# ... in rows that stop where their prefix is less likely than this: low, as the tree's ranking
# by calibrated reach picks what its budget takes (bench-topk, budget 64, MAT with the top-k fed
# back against without: 0.02 gave 1.223x, 0.01 1.234x, 0.005 1.249x, 0.0025 1.252x).
SUCCESSOR_ROOT_MIN_PROB = 0.0025

# Columns of the per-tree ``jobs`` table, and the ``settings`` vector's fields.
JOB_COLUMNS = ("row", "suffix_start", "suffix_end", "exclude_start", "exclude_end", "depth", "budget",
               "depth_reserve", "remember", "track")  # fmt: skip
ROW, SUFFIX_START, SUFFIX_END, EXCLUDE_START, EXCLUDE_END, DEPTH, BUDGET, DEPTH_RESERVE, REMEMBER, TRACK = range(10)
SETTINGS = ("max_match", "samples", "context_samples", "leader_len", "follower_len", "max_followers", "buckets",
            "stop", "window")  # fmt: skip

_RO_FOLLOWERS = types.Array(types.int32, 2, "C", readonly=True)
_RO_PROBS = types.Array(types.uint16, 2, "C", readonly=True)
_RO_OFFSETS = types.Array(types.int64, 1, "C", readonly=True)
_RO_TABLE = types.Tuple((_RO_OFFSETS, _RO_FOLLOWERS, _RO_PROBS))


def prior_args(
    orders: np.ndarray,
    keys: np.ndarray,
    owner: np.ndarray,
    slot: np.ndarray,
    tables: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple:
    """A static prior as :func:`draft_batch` takes it: leader lengths per table (longest
    first), every table's leader hashes sorted (``keys``) with the table (``owner``) and leader
    (``slot``) of each, and per table ``(offsets, followers, probability bits)`` as
    :meth:`~indexer.ngram_table.NgramTable.search_arrays` gives them. All read-only views in
    one typed list, so built, loaded and memory-mapped priors, and no prior (empty ones), are one
    type to the compiler: one compiled step serves them all. One list of the tables' tuples, not
    a list per array: each typed list a call takes costs it about a microsecond to unbox."""
    held = typed.List.empty_list(_RO_TABLE)
    for off, fol, bits in tables:
        held.append((read_only(off, np.int64), read_only(fol, np.int32), read_only(bits, np.uint16)))
    return (
        read_only(orders, np.int64), read_only(keys, np.uint64), read_only(owner, np.int64),
        read_only(slot, np.int64), held,
    )  # fmt: skip


@functools.cache
def no_prior() -> tuple:
    """:func:`prior_args` of a namespace without a static prior (made once)."""
    empty = np.zeros(0, dtype=np.int64)
    return prior_args(empty, np.zeros(0, dtype=np.uint64), empty, empty, [])


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


@njit(cache=True, nogil=True, inline="always")
def _confidence(tier: int, n: int, half: np.ndarray, hits: np.ndarray, pred: np.ndarray, buckets: int) -> float:
    """A tier's confidence at match length ``n``: its prior ``n / (n + half)`` times its
    calibration factor (accepted + 2) / (predicted + 2) for that length's bucket, at most 1."""
    b = min(n, buckets)
    return min(1.0, (n / (n + half[tier])) * ((hits[tier, b] + 2.0) / (pred[tier, b] + 2.0)))


@njit(cache=True, nogil=True, inline="always")
def _excluded(token: int, exclude: np.ndarray) -> bool:
    for e in range(exclude.size):  # noqa: SIM110 (compiled: a plain loop, no generator)
        if exclude[e] == token:
            return True
    return False


@njit(cache=True, nogil=True, inline="always")
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
def _slots(jobs: np.ndarray) -> np.ndarray:
    """Where each tree may start in the output buffers: room for its budget."""
    slot = np.zeros(jobs.shape[0] + 1, dtype=np.int64)
    for j in range(jobs.shape[0]):
        slot[j + 1] = slot[j] + max(0, jobs[j, BUDGET])
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
def job_context(i32: Any, i64: Any, row: int, suffix: np.ndarray) -> np.ndarray:
    """A tree's context: the session's tokens, then ``suffix`` (a supposed verification
    outcome, when drafting ahead)."""
    base = i32[row * I32_PER_ROW + CTX][: i64[row * I64_PER_ROW + STATE][LEN]]
    if suffix.size == 0:
        return base
    ctx = np.empty(base.size + suffix.size, dtype=np.int32)
    ctx[: base.size] = base
    ctx[base.size :] = suffix
    return ctx


@njit(cache=True, nogil=True, inline="always")
def _exact_rest(exact: np.ndarray, state: np.ndarray, ctx: np.ndarray, depth: int, remember: bool) -> tuple:
    """The rest of the response cached for an identical prompt, while the output so far (``ctx``
    past the prompt) agrees with it, and the match length it stands for (0: none). Only the
    tokens generated since the last check are compared; with ``remember`` the state keeps how
    far they agree."""
    prompt_len = state[PROMPT_LEN]
    done = ctx.size - prompt_len
    known = state[EXACT_AGREES]
    if exact.size == 0 or known < 0 or done >= exact.size:
        return exact[:0], 0
    if known < done:
        for i in range(known, done):
            if exact[i] != ctx[prompt_len + i]:
                if remember:
                    state[EXACT_AGREES] = -1
                return exact[:0], 0
        if remember:
            state[EXACT_AGREES] = done
    return exact[done : done + depth], max(1, done + 1)


@njit(cache=True, nogil=True)
def _draft_one(j: int, args: tuple, out: tuple) -> None:
    """Tree ``j`` of :func:`draft_batch` (``args``: its arguments; ``out``: :func:`_outputs`):
    written at ``slot[j]`` (``sizes[j]`` nodes) with its rows of ``first_tok``, ``guess`` and
    ``lengths``. It writes nothing another tree writes (apart from its session's exact-prompt
    state, when it remembers, and a session has one such tree a call), so the trees may be
    drafted in any order, or at once."""
    (
        jobs, min_score, suffix, exclude, prior_orders, prior_keys, prior_owner, prior_slot, prior_tables,
        i32, i64, main_tokens, main_sa, run_tokens, run_sa, run_offsets, table_keys,
        table_offsets, table_followers, table_probs, table_ll, main_serial, succ_followers, succ_weights, succ_norm,
        settings, half, hits, pred, score_edges, cell_hits, cell_trials, coarse, fine_prior
    ) = args  # fmt: skip
    tokens, parents, sources, scores, slot, sizes, first_tok, guess, lengths, _ = out
    n_tiers = half.size
    max_match, samples, ctx_samples = settings[0], settings[1], settings[2]
    leader_len, follower_len, max_followers = settings[3], settings[4], settings[5]
    buckets, stop, window = settings[6], settings[7], settings[8]
    conf_of = np.zeros(n_tiers)
    at = np.zeros(3, dtype=np.int64)
    row = jobs[j, ROW]
    state = i64[row * I64_PER_ROW + STATE]
    ctx = job_context(i32, i64, row, suffix[jobs[j, SUFFIX_START] : jobs[j, SUFFIX_END]])
    idx_tok = i32[row * I32_PER_ROW + SA_TOKENS]
    idx_sa = i32[row * I32_PER_ROW + SA]
    indexed, since = state[INDEXED], max(0, state[PROMPT_LEN] - window)
    depth, budget = jobs[j, DEPTH], jobs[j, BUDGET]
    excl = exclude[jobs[j, EXCLUDE_START] : jobs[j, EXCLUDE_END]]
    n_c, rows_c, w_c = context_continuations(
        ctx, idx_tok, idx_sa, indexed, max_match, state[HINT_CTX], depth, ctx_samples, stop
    )
    rows_d, w_d = context_followers(ctx, idx_tok, idx_sa, indexed, since, leader_len, follower_len, max_followers)
    rejected = i64[row * I64_PER_ROW + REJECTED_TABLE]
    rows_r, w_r = lru.candidates(rejected, ctx)
    best, rows_l, w_l, main_match = stacked_continuations(
        main_tokens, main_sa, run_tokens, run_sa, run_offsets, ctx, max_match, state[HINT_LIFE], depth, samples, stop,
        _main_prior(state, ctx.size, main_serial),
    )  # fmt: skip
    leader = -1
    if best > 0 and table_ll > 0 and best <= table_ll:
        leader = find_leader(ctx, table_ll, table_keys)
    exact_rest, n_x = _exact_rest(i32[row * I32_PER_ROW + EXACT], state, ctx, depth, jobs[j, REMEMBER] != 0)
    hit = find_longest_leader(ctx, prior_orders, prior_keys, prior_owner)
    p_table, p_lo, p_hi, p_cells = 0, 0, 0, 0
    if hit >= 0:
        p_table = prior_owner[hit]
        p_offsets, p_followers, _ = prior_tables[p_table]
        p_lo, p_hi = p_offsets[prior_slot[hit]], p_offsets[prior_slot[hit] + 1]
        p_cells = (p_hi - p_lo) * p_followers.shape[1]
    rows_s, probs_s = successor_rows(
        succ_followers, succ_weights, succ_norm, ctx[-1] if ctx.size else -1, depth, SUCCESSOR_MIN_PROB
    )
    succ_conf = _confidence(SUCCESSOR, 1, half, hits, pred, buckets)  # its own rows', and those it carries on
    bound_r = rows_c.size + rows_d.size + rows_r.size + rows_l.size + exact_rest.size + p_cells + rows_s.size
    if leader >= 0:
        bound_r += (table_offsets[leader + 1] - table_offsets[leader]) * table_followers.shape[1]
    bound_v = bound_r + rows_c.shape[0] + rows_d.shape[0] + rows_r.shape[0] + rows_l.shape[0] + 1
    rows_flat = np.empty(bound_r, dtype=np.int32)
    vals_flat = np.empty(bound_v)
    meta = np.zeros((7, 4), dtype=np.int64)  # at most a part per tier, one of the two lifetime tiers
    confs = np.zeros(7)
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
    if w_r.size:  # the rejected tier comes before the lifetime tiers, the others after
        n_r = rejected[lru.LL]
        conf_of[REJECTED] = _confidence(REJECTED, n_r, half, hits, pred, buckets)
        lengths[j, REJECTED] = n_r
        _put(rows_r, w_r.reshape((-1, 1)), False, REJECTED, conf_of[REJECTED], excl, rows_flat, vals_flat, meta,
             confs, at)  # fmt: skip
    if leader >= 0:
        lo, hi = table_offsets[leader], table_offsets[leader + 1]
        conf_of[LIFETIME_NGRAM] = _confidence(LIFETIME_NGRAM, table_ll, half, hits, pred, buckets)
        lengths[j, LIFETIME_NGRAM] = table_ll
        probs = half_to_float(table_probs[lo:hi])
        _put(table_followers[lo:hi], probs, True, LIFETIME_NGRAM, conf_of[LIFETIME_NGRAM], excl, rows_flat,
             vals_flat, meta, confs, at)  # fmt: skip
    elif best > 0:
        conf_of[LIFETIME_SA] = _confidence(LIFETIME_SA, best, half, hits, pred, buckets)
        lengths[j, LIFETIME_SA] = best
        _put(rows_l, w_l.reshape((-1, 1)), False, LIFETIME_SA, conf_of[LIFETIME_SA], excl, rows_flat, vals_flat,
             meta, confs, at)  # fmt: skip
    if hit >= 0:
        n_p = prior_orders[p_table]
        conf_of[PRIOR] = _confidence(PRIOR, n_p, half, hits, pred, buckets)
        lengths[j, PRIOR] = n_p
        _, p_followers, p_bits = prior_tables[p_table]
        probs = half_to_float(p_bits[p_lo:p_hi])
        _put(p_followers[p_lo:p_hi], probs, True, PRIOR, conf_of[PRIOR], excl, rows_flat, vals_flat,
             meta, confs, at)  # fmt: skip
    if n_x > 0:
        conf_of[EXACT_TIER] = _confidence(EXACT_TIER, n_x, half, hits, pred, buckets)
        lengths[j, EXACT_TIER] = n_x
        _put(exact_rest.reshape((1, -1)), np.ones((1, 1)), False, EXACT_TIER, conf_of[EXACT_TIER], excl, rows_flat,
             vals_flat, meta, confs, at)  # fmt: skip
    if rows_s.shape[0] > 0:
        conf_of[SUCCESSOR] = succ_conf
        lengths[j, SUCCESSOR] = 1
        _put(rows_s, probs_s, True, SUCCESSOR, conf_of[SUCCESSOR], excl, rows_flat, vals_flat, meta, confs, at)
    n_parts = at[0]
    if n_parts > 0 and budget > 0 and depth > 0:
        rows, vals, is_max, tiers = stack_parts(
            rows_flat[: at[1]], vals_flat[: at[2]], meta[:n_parts], confs[:n_parts], depth
        )
        # The successor tier carries on the other tiers' likeliest first tokens too.
        ext_r, ext_v = successor_extensions(
            rows, vals, tiers, SUCCESSOR, succ_followers, succ_weights, succ_norm, SUCCESSOR_ROOT_MIN_PROB, succ_conf,
            SUCCESSOR_ROOTS,
        )  # fmt: skip
        if ext_r.shape[0] > 0:
            rows = np.concatenate((rows, ext_r))
            vals = np.concatenate((vals, ext_v))
            is_max = np.concatenate((is_max, np.ones(ext_r.shape[0], dtype=np.bool_)))
            tiers = np.concatenate((tiers, np.full(ext_r.shape[0], SUCCESSOR, dtype=np.int64)))
        calibration = (jobs[j, TRACK], score_edges, cell_hits, cell_trials, coarse, fine_prior)
        tok, par, src, sc, ft, fv = merge_tree(
            rows, vals, is_max, tiers, n_tiers, budget, min_score[j], jobs[j, DEPTH_RESERVE], calibration
        )
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
    if jobs[j, REMEMBER] != 0:
        _remember(j, state, i32, row * I32_PER_ROW + TREE, out)
        # Where the next step's searches start: the match lengths found, and the main
        # index's match with its rows.
        state[HINT_CTX], state[HINT_LIFE] = lengths[j, CONTEXT], best
        state[MATCH_SERIAL], state[MATCH_AT] = main_serial, ctx.size
        state[MATCH_LEN], state[MATCH_FIRST], state[MATCH_LAST] = main_match


@njit(cache=True, nogil=True, inline="always")
def _main_prior(state: np.ndarray, size: int, serial: int) -> tuple[int, int, int, int]:
    """The lifetime main index's match at the session's last draft, carried to a context of
    ``size`` tokens that extends that draft's, as :func:`stacked_continuations` takes it:
    ``(hint, known, lo, hi)`` (``known`` 0: none, or the main index changed since)."""
    n = state[MATCH_LEN]
    if n == 0 or state[MATCH_SERIAL] != serial or size < state[MATCH_AT]:
        return 0, 0, 0, 0
    return n + size - state[MATCH_AT], n, state[MATCH_FIRST], state[MATCH_LAST]


@njit(cache=True, nogil=True)
def _remember(j: int, state: np.ndarray, i32: Any, at: int, out: tuple) -> None:
    """Tree ``j``'s session keeps it, and its first guesses, until the outcome comes."""
    tokens, parents, sources, scores, slot, sizes, first_tok, guess, lengths, grown = out
    a, k = slot[j], sizes[j]
    held = i32[at]
    kept = write_tree(held, state, tokens[a : a + k], parents[a : a + k], sources[a : a + k], scores[a : a + k])
    if kept.size != held.size:  # it outgrew the session's buffer
        i32[at] = kept
        grown[j] = GREW_TREE
    n_tiers = first_tok.shape[1]
    state[FIRST_TOKEN : FIRST_TOKEN + n_tiers] = first_tok[j]
    state[GUESS : GUESS + n_tiers].view(np.float64)[:] = guess[j]
    state[GUESS_LENGTH : GUESS_LENGTH + n_tiers] = lengths[j]
    state[GUESSED] = 1


@njit(cache=True, nogil=True)
def _outputs(jobs: np.ndarray, n_tiers: int) -> tuple:
    """What :func:`_draft_one` reads besides the arguments and writes: each tree's slot, the
    tree buffers, the trees' sizes and the per-tier guesses."""
    n_jobs = jobs.shape[0]
    slot = _slots(jobs)
    tokens, parents, sources, scores = tree_buffers(int(slot[n_jobs]))
    sizes = np.zeros(n_jobs, dtype=np.int64)
    first_tok = np.full((n_jobs, n_tiers), -1, dtype=np.int64)
    guess = np.zeros((n_jobs, n_tiers))
    lengths = np.zeros((n_jobs, n_tiers), dtype=np.int64)
    grown = np.zeros(n_jobs, dtype=np.int64)
    return tokens, parents, sources, scores, slot, sizes, first_tok, guess, lengths, grown


@njit(cache=True, nogil=True)
def _results(out: tuple) -> tuple:
    """:func:`draft_batch`'s return value from the written outputs."""
    tokens, parents, sources, scores, slot, sizes, _, _, _, grown = out
    tokens, parents, sources, scores, offsets = _packed(tokens, parents, sources, scores, slot, sizes)
    return tokens, parents, sources, scores, offsets, grown


@njit(cache=True, nogil=True)
def draft_batch(
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
) -> tuple:
    """Draft trees for a batch of jobs, each over a session its store holds.

    Job ``j`` is row ``j`` of ``jobs`` (columns :data:`JOB_COLUMNS`): the session at store row
    ``row`` (its arrays in ``i32`` and ``i64``, see :mod:`indexer.kernels.store`), its context
    extended by ``suffix[suffix_start:suffix_end]``; the tree takes at most ``budget`` nodes,
    ``depth`` levels and reserves ``depth_reserve`` nodes for its best chain, keeping nodes
    scoring above ``min_score[j]``; root children whose token is in
    ``exclude[exclude_start:exclude_end]`` are left out. A job's nodes rank by score when its
    ``track`` is negative; otherwise by their chance of acceptance for a session of that track
    record (see :func:`~indexer.kernels.tree.merge_tree`), as the chain calibrator's counts
    (``score_edges`` to ``fine_prior``, as :func:`~indexer.kernels.draft_chain.draft_chain_batch`
    takes them) tell it. With ``remember`` the session keeps
    the tree and its first guesses (until :func:`~indexer.kernels.accept.accept_batch` takes
    the outcome), how far its output agrees with an exact-prompt response and the match lengths
    its own-context and lifetime-suffix searches found (where the next step's searches start).
    The session gives its own context (prompt index and the rest), dynamic followers from
    ``settings``' window of the prompt on, rejected table and exact-prompt response. The static
    prior (the ``prior_*`` arguments, see :func:`prior_args`) answers with the followers of the
    longest of its leaders the context ends with. Parts merge in tier order: own context,
    dynamic, rejected, lifetime, prior, exact, successor.

    The lifetime memory is the main suffix index and its delta runs (see
    :func:`~indexer.kernels.search.stacked_continuations`) plus the frozen table over the main
    index (``table_probs`` as float16 bits) whose leaders are ``table_ll`` tokens (0: no table).
    A lifetime match no longer than the table's leaders is answered by the table's followers
    when it holds the leader. ``main_serial`` names the main index's generation: a session's
    match in it carries to its next search while the same one serves. Confidence per tier:
    :func:`_confidence` over ``half`` and the calibration counts ``hits`` and ``pred`` (tiers x
    buckets + 1). The successor table (``succ_*``, see :mod:`indexer.kernels.successors`; empty
    arrays: none) drafts chains of the target's own likeliest followers of the context's last
    token.

    Returns the trees end to end ``(tokens, parents, sources, scores, offsets)`` and per tree
    whether its session's tree buffer had to grow (the store holds the new one). Each tier's
    first guess (its token, its probability under that tier alone times the tier's prior, the
    match length behind it) stays in the session for calibration, not in the result: an
    array returned costs the call as much as several taken.
    """
    args = (
        jobs, min_score, suffix, exclude, prior_orders, prior_keys, prior_owner, prior_slot, prior_tables,
        i32, i64, main_tokens, main_sa, run_tokens, run_sa, run_offsets, table_keys,
        table_offsets, table_followers, table_probs, table_ll, main_serial, succ_followers, succ_weights, succ_norm,
        settings, half, hits, pred, score_edges, cell_hits, cell_trials,
        chain_backoff(coarse_hits, coarse_trials, claim, coarse_prior), fine_prior,
    )  # fmt: skip
    out = _outputs(jobs, half.size)
    for j in range(jobs.shape[0]):
        _draft_one(j, args, out)
    return _results(out)


@njit(cache=True, nogil=True, parallel=True)
def draft_batch_parallel(
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
) -> tuple:
    """:func:`draft_batch` (the same arguments) with the trees shared among the compiled
    code's worker threads: the same trees, each depending on its own inputs only. The
    arguments are named: dispatching a star-args signature costs about 0.2 ms a call, as much
    as several trees. It is a second function, not ``draft_batch``'s compiled with other flags:
    numba's on-disk cache keys a function by its code, not its flags, so the two would load
    each other's machine code. A test holds the two parameter lists equal.
    """
    args = (
        jobs, min_score, suffix, exclude, prior_orders, prior_keys, prior_owner, prior_slot, prior_tables,
        i32, i64, main_tokens, main_sa, run_tokens, run_sa, run_offsets, table_keys,
        table_offsets, table_followers, table_probs, table_ll, main_serial, succ_followers, succ_weights, succ_norm,
        settings, half, hits, pred, score_edges, cell_hits, cell_trials,
        chain_backoff(coarse_hits, coarse_trials, claim, coarse_prior), fine_prior,
    )  # fmt: skip
    out = _outputs(jobs, half.size)
    for j in prange(jobs.shape[0]):
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

"""Compiled inner loops (numba, as vLLM's n-gram proposer does): suffix-array searches, the
own-context scan, the draft-tree merge and suffix array construction. Everything else stays in numpy.

Each kernel is plain Python over numpy arrays; ``NUMBA_DISABLE_JIT=1`` runs them uncompiled
for debugging. Compiled code is cached beside the module, so only the first process on a machine
pays the compile time; :func:`warm_up` pays it at start-up rather than on a first request. A
change to any kernel module recompiles every kernel (:mod:`indexer.kernels.cache`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

# First: the kernels' cache entries are located, and so stamped, as they are defined.
from indexer.kernels import cache  # noqa: F401

# isort: split
from indexer.kernels import lru
from indexer.kernels import store as kstore
from indexer.kernels.accept import accept_batch
from indexer.kernels.ahead import chain_fans, chain_outcomes, stopping_points, stopping_points_rows, subtree_nodes
from indexer.kernels.arrays import read_only
from indexer.kernels.chain import (
    DEPTHS,
    RANKS,
    RATIO_BINS,
    TRACKS,
    chain_backoff,
    chain_batch,
    chain_cells,
    chain_conditional,
    chain_outcome,
    chain_outcome_rows,
    chain_path,
    chain_pick,
    chain_reach,
    chain_reach_outcome,
)
from indexer.kernels.draft import calibrate, draft_batch, draft_batch_parallel, no_prior, prior_args
from indexer.kernels.draft_chain import draft_chain_batch
from indexer.kernels.search import (
    context_continuations,
    context_followers,
    gather_rows,
    longest_match,
    match_range,
    prompt_lookup_start,
    recent_followers,
    sample_rows,
    sample_starts,
    stacked_continuations,
    tail_matches,
)
from indexer.kernels.successors import successor_observe, successor_rows
from indexer.kernels.suffix_sort import lcp, merge_suffix_arrays, suffix_array
from indexer.kernels.tables import (
    find_leader,
    find_longest_leader,
    follower_lengths,
    hash_rows,
    hash_tokens,
    leader_runs,
    table_entries,
)
from indexer.kernels.tree import (
    accepted_path,
    merge_batch,
    merge_tree,
    no_calibration,
    rejected_branches,
    verification_outcome,
    verification_outcomes,
)

# Threading layers that take threaded calls from several threads at once ("workqueue" aborts).
_THREADSAFE_LAYERS = ("omp", "tbb")

__all__ = [
    "accept_batch",
    "accepted_path",
    "calibrate",
    "chain_backoff",
    "chain_batch",
    "chain_cells",
    "chain_conditional",
    "chain_fans",
    "chain_outcome",
    "chain_outcome_rows",
    "chain_outcomes",
    "chain_path",
    "chain_pick",
    "chain_reach",
    "chain_reach_outcome",
    "context_continuations",
    "context_followers",
    "draft_batch",
    "draft_batch_parallel",
    "draft_chain_batch",
    "draft_step",
    "find_leader",
    "find_longest_leader",
    "follower_lengths",
    "gather_rows",
    "hash_rows",
    "hash_tokens",
    "lcp",
    "leader_runs",
    "longest_match",
    "match_range",
    "merge_batch",
    "merge_suffix_arrays",
    "merge_tree",
    "no_calibration",
    "no_prior",
    "prefer_passive_workers",
    "prior_args",
    "prompt_lookup_start",
    "read_only",
    "recent_followers",
    "rejected_branches",
    "sample_rows",
    "sample_starts",
    "stacked_continuations",
    "stopping_points",
    "stopping_points_rows",
    "subtree_nodes",
    "successor_observe",
    "successor_rows",
    "suffix_array",
    "table_entries",
    "tail_matches",
    "verification_outcome",
    "verification_outcomes",
    "warm_up",
    "warm_up_beside_draft_step",
    "warm_up_draft_step",
    "warm_up_threads",
]


def warm_up() -> None:
    """Compile (or load from cache) every kernel now, off any request's path."""
    for part in (_warm_up_searches, warm_up_draft_step, warm_up_beside_draft_step, _warm_up_chain_step):
        part()


def _warm_up_indexes() -> None:
    """A rebuild's kernels: suffix arrays and the frozen tables (indexer.ngram_table), with the
    types a rebuild passes; none of them is part of a draft step."""
    toks = np.array([1, 2, 1, 2, 2147483647], dtype=np.int32)
    sa = np.array([0, 2, 1, 3, 4], dtype=np.int32)
    follow = follower_lengths(toks, sa, 1, 1, 2147483647)
    common = lcp(toks, suffix_array(toks))
    firsts, _ = leader_runs(common, follow, 1)
    table_entries(common, follow, sa, firsts, np.array([0], dtype=np.int64), 1, 1, 1)
    # A rebuild that extends the last one (as indexer.suffix_array passes its arguments).
    merge_suffix_arrays(read_only(toks, np.int32), read_only(sa, np.int32), 2, sa[:1])
    match_range(toks, sa, np.array([1], dtype=np.int32), 0, 5)
    prompt_lookup_start(np.array([1, 2, 1], dtype=np.int32), 1, 3)
    hash_rows(np.zeros((1, 2), dtype=np.int32))


def warm_up_beside_draft_step() -> None:
    """The kernels no draft step calls: a rebuild's, a verification outcome's, a chain's pick
    and the batch merge of candidates gathered in Python (compiled beside
    :func:`warm_up_draft_step` on a first start, sharing little with it)."""
    _warm_up_indexes()
    _warm_up_outcomes()
    _warm_up_chains()
    rows = np.array([[1, 2], [1, -1]], dtype=np.int32)
    meta = np.array([[2, 2, 1, 1]], dtype=np.int64)
    ints = np.array([2], dtype=np.int64)
    merge_batch(rows.ravel(), np.ones(4), meta, np.ones(1), np.array([0, 1], dtype=np.int64), ints, ints,
                np.zeros(1), ints, 7)  # fmt: skip


def _warm_up_searches() -> None:
    """The searches and a tree's merge as entry points of their own (the draft step compiles
    them into itself)."""
    toks = np.array([1, 2, 1, 2, 2147483647], dtype=np.int32)
    sa = np.array([0, 2, 1, 3, 4], dtype=np.int32)
    longest_match(toks, sa, np.array([1, 2], dtype=np.int32), 4, 1, 0)
    sample_starts(sa, 0, 2, 2)
    tail_matches(np.array([1, 2, 1], dtype=np.int32), 0, 4)
    context_continuations(toks, toks, sa, 4, 4, 0, 2, 2, 2147483647)
    context_followers(toks, toks, sa, 4, 0, 1, 1, 2)
    recent_followers(toks, sa[:1], 2, 0, 1, 1, 2)
    sample_rows(toks, sa, 0, 2, 1, 2, 2, 2147483647)
    offsets = np.array([0, 5], dtype=np.int64)
    stacked_continuations(toks, sa, toks, sa, offsets, np.array([1, 2], dtype=np.int32), 4, 0, 2, 2, 2147483647)
    stacked_continuations(
        toks, sa, toks, sa, offsets, np.array([1, 2], dtype=np.int32), 4, 0, 2, 2, 2147483647, (2, 1, 0, 5)
    )
    find_leader(np.array([1, 2], dtype=np.int32), 2, np.zeros(1, dtype=np.uint64))
    rows = np.array([[1, 2], [1, -1]], dtype=np.int32)
    merge_tree(rows, np.ones((2, 2)), np.zeros(2, dtype=np.bool_), np.zeros(2, dtype=np.int64), 7, 4, 0.0, 1,
               _tiny_calibration(0))  # fmt: skip


def warm_up_draft_step() -> None:
    """The draft step, with everything it calls compiled into it: the longest compilation."""
    i32, i64 = _tiny_store()
    draft_batch(*_tiny_draft(i32, i64))
    kstore.put_i32(i32, 0, kstore.get_i32(i32, 0))
    kstore.put_i64(i64, 1, kstore.get_i64(i64, 1))


def _warm_up_outcomes() -> None:
    """What a verification's outcome runs: the accept step, the trees' outcomes and
    calibration, drafting ahead for outcomes, the per-session tables' upkeep."""
    toks = np.array([1, 2, 1, 2, 2147483647], dtype=np.int32)
    one = np.array([1], dtype=np.int32)
    root = np.array([-1], dtype=np.int32)
    one_tree = np.array([0, 1], dtype=np.int64)
    sizes, ints = one_tree[1:], np.array([2], dtype=np.int64)
    accepted_path(one, root, one)
    rejected_branches(one, root, np.ones(1, dtype=np.float32), -1, 2)
    verification_outcome(one, root, np.ones(1, dtype=np.float32), one, 2)
    verification_outcomes(
        one, root, np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.uint8), one_tree[:1], sizes, one, sizes, sizes,
        2, 7,
    )  # fmt: skip
    guesses = np.full((1, 8), -1, dtype=np.int64)
    calibrate(np.zeros((8, 5)), np.zeros((8, 5)), guesses, np.zeros((1, 8)), guesses, one_tree[:1], one_tree[:1], 4)
    i32, i64 = _tiny_store()
    items = np.array([[0, 0, 1, 4], [1, 1, 2, 0]], dtype=np.int64)
    counts = np.zeros((8, 5))
    accept_batch(items, np.array([1, 9], np.int32), i32, i64, counts, counts.copy(), 4, np.zeros(8, np.int64))
    tree = np.zeros(8, dtype=np.int32)
    state = np.zeros(kstore.STATE_SIZE, dtype=np.int64)
    kept = kstore.write_tree(tree, state, one, root, one, np.ones(1, dtype=np.float32))
    kstore.read_tree(kept, 1)
    stopping_points(one, root, np.ones(1, dtype=np.float32), 2)
    outcomes = chain_outcomes(
        np.zeros(1, dtype=np.int64), np.ones(1), ints, one, sizes, one, np.ones(1, dtype=np.float32), one_tree
    )
    chain_fans(outcomes[1], one, np.zeros(1, dtype=np.uint8), np.ones(1, dtype=np.float32), one,
               np.zeros(1, dtype=np.uint8), np.ones(1, dtype=np.float32), one_tree)  # fmt: skip
    subtree_nodes(one, root, 1)
    for at in (-1, 0):  # stored scores, and probabilities given
        reach_at = np.array([at, -1], dtype=np.int64)
        stopping_points_rows(i32, i64, one_tree, np.array([2, 2], dtype=np.int64), np.ones(1, np.float32), reach_at)
    table = lru.new_table(2, 2, 2, 4)
    for key in (toks, toks.astype(np.int64)):  # the accept step's and the table's own callers'
        table = lru.add(table, key, 0, key, 1, 2, 1)
    lru.followers_at(table, lru.find(table, key, 0), True)
    lru.leaders_oldest_first(table)
    lru.candidates(table, toks)
    lru.columns(table)  # a session's write-back
    followers, weights, norm = np.full((2, 8), -1, dtype=np.int32), np.zeros((2, 8)), np.zeros(2)
    successor_observe(followers, weights, norm, one, np.ones((1, 2), dtype=np.int32), 0.9, np.ones(8))
    successor_rows(followers, weights, norm, 1, 2, 0.0)


def _warm_up_chain_step() -> None:
    """The chain draft step: the draft step's pieces and a chain's pick."""
    reached = np.zeros((TRACKS, DEPTHS, 12))
    chain_args = (
        *_tiny_draft(), np.full(2, 4), np.zeros(2), np.zeros(2, dtype=np.int64), reached, reached, np.ones(11), 8.0,
    )  # fmt: skip
    draft_chain_batch(*chain_args)


def _warm_up_chains() -> None:
    """Chain mode apart from its draft step: a chain's pick from a tree and what its outcome
    teaches the calibrator."""
    toks = np.array([1, 2, 1, 2, 2147483647], dtype=np.int32)
    one = np.array([1], dtype=np.int32)
    root = np.array([-1], dtype=np.int32)
    one_tree = np.array([0, 1], dtype=np.int64)
    ints = np.array([2], dtype=np.int64)
    cells = np.zeros((RATIO_BINS, 7, 8, DEPTHS, TRACKS, RANKS))  # indexer.chain's calibrator, its types
    coarse = chain_backoff(np.zeros((RATIO_BINS, TRACKS)), np.zeros((RATIO_BINS, TRACKS)), np.ones(RATIO_BINS), 2.0)
    reached = np.zeros((TRACKS, DEPTHS, 12))
    chain_pick(root, np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.uint8), np.ones(6), 0, cells, cells, coarse,
               4.0, 2, 0.1, reached[0], reached[0], np.ones(11), 8.0)  # fmt: skip
    chain_batch(one, root, np.zeros(1, dtype=np.uint8), np.ones(1, dtype=np.float32), one_tree, ints, np.ones(1),
                ints, np.ones(6), cells, cells, coarse, 4.0, reached, reached, np.ones(11), 8.0)  # fmt: skip
    # The held trees' outcomes learnt in one pass.
    coarse_counts = np.zeros((RATIO_BINS, TRACKS))
    i32b, i64b = _tiny_store()
    chain_outcome_rows(i32b, i64b, np.zeros(2, dtype=np.int64), toks[:2].copy(), np.array([0, 1, 2]),
                       np.zeros(2, dtype=np.int64), np.ones(6), cells, cells.copy(), coarse_counts,
                       coarse_counts.copy())  # fmt: skip
    # A node's cell, its probability, the chosen path and an outcome's count.
    cells = chain_cells(root, np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.uint8), np.ones(1), 0)
    grid = np.zeros((RATIO_BINS, 7, 8, DEPTHS, TRACKS, RANKS))
    chain_conditional(cells, grid, grid, np.ones((9, 4)), 1.0)
    chain_path(root, np.ones(1), np.ones(1), 2, 0.0)
    chain_reach(root, np.ones(1))
    chain_outcome(root, one, one, cells, grid, grid.copy(), np.zeros((9, 4)), np.zeros((9, 4)))
    chain_reach_outcome(one, np.ones(1), one, reached[0], reached[0].copy(), np.ones(11))


def _tiny_store() -> tuple:
    """Store lists holding two small sessions (compiled steps' argument types)."""
    i32, i64 = kstore.new_lists()
    toks = np.array([1, 2, 1, 2, 2147483647], dtype=np.int32)
    sa = np.array([0, 2, 1, 3, 4], dtype=np.int32)
    for row in range(2):
        state = np.zeros(kstore.STATE_SIZE, dtype=np.int64)
        state[: kstore.TREE_SIZE + 1] = [5, 5, 4, 0, 0, 0, -1]
        table = lru.new_table(2, 2, 2, 4)
        tree = np.zeros(8, dtype=np.int32)
        kstore.put_row(i32, i64, row, np.concatenate((toks, toks)), toks, sa, toks[:2].copy(), tree, state, table)
    return i32, i64


def _tiny_calibration(track: int) -> tuple:
    """A :func:`merge_tree` calibration of :mod:`indexer.chain`'s types, for sessions of track
    record ``track`` (-1: nodes ranked by score)."""
    cells = np.zeros((RATIO_BINS, 7, 8, DEPTHS, TRACKS, RANKS))
    return track, np.ones(6), cells, cells, np.ones((RATIO_BINS, TRACKS)), 4.0


def _tiny_draft(i32: Any = None, i64: Any = None) -> tuple:
    """Arguments of a two-tree :func:`draft_batch` call over the store lists ``i32`` and
    ``i64`` (else a new :func:`_tiny_store`), to compile it."""
    toks = np.array([1, 2, 1, 2, 2147483647], dtype=np.int32)
    sa = np.array([0, 2, 1, 3, 4], dtype=np.int32)
    rows = np.array([[1, 2], [1, -1]], dtype=np.int32)
    one = np.array([1], dtype=np.int32)
    one_tree = np.array([0, 1], dtype=np.int64)
    offsets = np.array([0, 5], dtype=np.int64)
    jobs = np.array([[0, 0, 1, 0, 1, 2, 4, 1, 1, -1], [1, 0, 0, 0, 0, 2, 4, 1, 0, 0]], dtype=np.int64)
    key = hash_tokens(toks, 3, 1)  # a one-token prior leader: "2"
    prior = prior_args(
        np.array([1]), np.array([key], dtype=np.uint64), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
        [(one_tree, rows, np.zeros((2, 2), dtype=np.uint16))],
    )  # fmt: skip
    if i32 is None or i64 is None:
        i32, i64 = _tiny_store()
    return (
        jobs, np.zeros(2), one, one, *prior, i32, i64,
        toks, sa, toks, sa, offsets, np.zeros(1, dtype=np.uint64), one_tree, rows, np.zeros((2, 2), dtype=np.uint16),
        2, 1, np.full((2, 8), -1, dtype=np.int32), np.zeros((2, 8)), np.zeros(2),
        np.array([32, 4, 4, 2, 2, 2, 4, 2147483647, 2048], dtype=np.int64), np.ones(8), np.zeros((8, 5)),
        np.zeros((8, 5)), *_tiny_calibration(0)[1:4], np.zeros((RATIO_BINS, TRACKS)),
        np.zeros((RATIO_BINS, TRACKS)), np.ones(RATIO_BINS), 2.0, 4.0,
    )  # fmt: skip


def prefer_passive_workers() -> None:
    """Let the threaded draft step's worker threads sleep between calls instead of spinning
    (GNU OpenMP's default), unless the environment already chose: a service's event loop and
    other processes need that CPU more. Entry points call it, before any threaded call: OpenMP
    reads ``OMP_WAIT_POLICY`` once, when the threading layer first loads, and the variable is
    the whole process's, which importing a library must leave alone."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def warm_up_threads() -> bool:
    """Compile (or load) the threaded draft step and run it once. False when the threading
    layer found cannot take threaded calls from several threads at once: then only the
    single-threaded step is safe in a service."""
    draft_batch_parallel(*_tiny_draft())
    return numba.threading_layer() in _THREADSAFE_LAYERS


def draft_step(threads: int) -> Callable[..., tuple]:
    """The batch draft step sharing its sequences among ``threads`` worker threads (at most
    as many as the compiled code has; 1: the calling thread alone) for calls from this thread."""
    if threads <= 1:
        return draft_batch
    threads = min(threads, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)  # per calling thread
    return draft_batch_parallel

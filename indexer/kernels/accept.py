"""A batch's accepted tokens in one compiled call: where verification left each session's last
tree, the calibration of each tier's first guess, the contexts extended and the rejected
branches recorded, in place in the sessions' arrays (:mod:`indexer.kernels.store`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from indexer.kernels import lru
from indexer.kernels.store import (
    CTX,
    FIRST_TOKEN,
    GREW_CONTEXT,
    GREW_TABLE,
    GUESS,
    GUESS_LENGTH,
    GUESSED,
    HINT_CTX,
    HINT_LIFE,
    I32_PER_ROW,
    I64_PER_ROW,
    LEN,
    N_TIERS,
    REJECTED_TABLE,
    STATE,
    TREE,
    TREE_SIZE,
    tree_views,
)
from indexer.kernels.tree import verification_outcome

# Columns of the per-session ``items`` table.
ITEM_COLUMNS = ("row", "new_start", "new_end", "branches")
ROW, NEW_START, NEW_END, BRANCHES = range(4)


@njit(cache=True, nogil=True)
def _extend(i32: Any, state: np.ndarray, row: int, new: np.ndarray) -> tuple[np.ndarray, bool]:
    """The session's context buffer with ``new`` appended, and whether it had to grow (the
    store then holds a new, larger buffer)."""
    at = row * I32_PER_ROW + CTX
    buf = i32[at]
    size = state[LEN]
    need = size + new.size
    grew = need > buf.size
    if grew:
        bigger = np.empty(max(need, 2 * buf.size), dtype=np.int32)
        bigger[:size] = buf[:size]
        i32[at] = bigger
        buf = bigger
    buf[size:need] = new
    state[LEN] = need
    return buf, grew


@njit(cache=True, nogil=True)
def _calibrate(state: np.ndarray, actual: int, hits: np.ndarray, pred: np.ndarray, buckets: int) -> None:
    """The session's kept first guesses counted against the token the target produced."""
    guess = state[GUESS:GUESS_LENGTH].view(np.float64)
    for t in range(N_TIERS):
        token = state[FIRST_TOKEN + t]
        if token >= 0:
            b = min(state[GUESS_LENGTH + t], buckets)
            pred[t, b] += guess[t]
            hits[t, b] += token == actual


@njit(cache=True, nogil=True)
def accept_batch(
    items: np.ndarray,
    new: np.ndarray,
    i32: Any,
    i64: Any,
    hits: np.ndarray,
    pred: np.ndarray,
    buckets: int,
    by_tier: np.ndarray,
) -> tuple[int, int, np.ndarray]:
    """Sessions take the tokens the target produced since their last draft, in order.

    Item ``j`` is row ``j`` of ``items`` (columns :data:`ITEM_COLUMNS`): the session at store
    row ``row`` produced ``new[new_start:new_end]`` (at least one token). Its last tree, when it
    has one, is verified: the accepted path is found (its nodes counted per source tier into
    ``by_tier``) and, where verification left the tree, its ``branches`` best rejected branches
    (see :func:`~indexer.kernels.tree.verification_outcome`) are recorded in the rejected table
    under the context's tail where they left. Its kept first guesses are counted against the
    first token produced into ``hits`` and ``pred`` per tier and match-length bucket. The
    context grows by the tokens, the match-length hints with it (a hint of 0 stays 0), and the
    tree and guesses are let go.

    Returns the trees verified, their nodes, and per item what had to grow (bits
    :data:`GREW_CONTEXT`, :data:`GREW_TABLE`): the store holds the new arrays.
    """
    n = items.shape[0]
    grown = np.zeros(n, dtype=np.int64)
    steps = drafted = 0
    for j in range(n):
        row = items[j, ROW]
        produced = new[items[j, NEW_START] : items[j, NEW_END]]
        state = i64[row * I64_PER_ROW + STATE]
        size = state[TREE_SIZE]
        depth = 0
        branch = np.zeros((0, 0), dtype=np.int32)
        kept = np.zeros(0, dtype=np.int64)
        if size >= 0:
            tokens, parents, sources, scores = tree_views(i32[row * I32_PER_ROW + TREE], size)
            path, branch, kept = verification_outcome(tokens, parents, scores, produced, items[j, BRANCHES])
            steps += 1
            drafted += size
            for i in range(path.size):
                by_tier[sources[path[i]]] += 1
            depth = path.size
        if state[GUESSED]:
            _calibrate(state, produced[0], hits, pred, buckets)
        before = state[LEN]
        buf, grew = _extend(i32, state, row, produced)
        if grew:
            grown[j] |= GREW_CONTEXT
        if kept.size:
            at = row * I64_PER_ROW + REJECTED_TABLE
            table = i64[at]
            ll, fl = table[lru.LL], table[lru.FL]
            end = before + depth
            if end >= ll:
                for r in range(kept.size):
                    updated = lru.add(table, buf, end - ll, branch[r], 0, min(kept[r], fl), 1)
                    if updated.size != table.size:  # it grew
                        i64[at] = updated
                        table = updated
                        grown[j] |= GREW_TABLE
        hint_ctx, hint_life = state[HINT_CTX], state[HINT_LIFE]
        state[HINT_CTX] = hint_ctx + produced.size if hint_ctx else 0
        state[HINT_LIFE] = hint_life + produced.size if hint_life else 0
        state[TREE_SIZE] = -1
        state[GUESSED] = 0
    return steps, drafted, grown

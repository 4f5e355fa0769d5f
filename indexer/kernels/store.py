"""Where compiled steps find a session's arrays: by its row in a store of typed lists.

A session keeps its state in arrays (:mod:`indexer.session`); a namespace's store lists them by
row, so one compiled call reads and updates a whole batch of sessions in place. Per row the
int32 list holds :data:`I32_PER_ROW` arrays (context buffer, prompt index tokens and suffix
array, exact-prompt response, last tree) and the int64 list :data:`I64_PER_ROW` (state,
rejected table).

A last tree of up to ``c`` nodes lies in an int32 array of ``4 * c``: tokens, parents, sources
and the scores' float32 bits, ``c`` of each.
"""

from __future__ import annotations

import numpy as np
from numba import njit, typed, types

# int32 arrays of a row, at row * I32_PER_ROW + ...
CTX, SA_TOKENS, SA, EXACT, TREE = range(5)
I32_PER_ROW = 5
# int64 arrays of a row, at row * I64_PER_ROW + ...
STATE, REJECTED_TABLE = range(2)
I64_PER_ROW = 2

# A session's state vector: context length, prompt length, tokens the prompt index covers, the
# last match lengths of the own-context and lifetime-suffix tiers (0: none), how many generated
# tokens are known to equal the exact-prompt response's start (-1: they differ), the last
# tree's nodes (-1: no tree), whether the last draft's first guesses are kept, and those: per
# tier its first token (-1: none), probability (float64 bits) and match length; then the
# longest match the lifetime main index held at the last draft: the index's generation, the
# context length then, the match length (0: none) and its SA rows.
LEN, PROMPT_LEN, INDEXED, HINT_CTX, HINT_LIFE, EXACT_AGREES, TREE_SIZE, GUESSED = range(8)
N_TIERS = 8
FIRST_TOKEN = 8
GUESS = FIRST_TOKEN + N_TIERS
GUESS_LENGTH = GUESS + N_TIERS
MATCH_SERIAL = GUESS_LENGTH + N_TIERS
MATCH_AT, MATCH_LEN, MATCH_FIRST, MATCH_LAST = MATCH_SERIAL + 1, MATCH_SERIAL + 2, MATCH_SERIAL + 3, MATCH_SERIAL + 4
STATE_SIZE = MATCH_SERIAL + 5

# What a compiled step replaced with a larger array (bits of its ``grown`` output).
GREW_CONTEXT, GREW_TABLE, GREW_TREE = 1, 2, 4

INT32_LIST = types.ListType(types.int32[::1])
INT64_LIST = types.ListType(types.int64[::1])


def new_lists() -> tuple[typed.List, typed.List]:
    return typed.List.empty_list(types.int32[::1]), typed.List.empty_list(types.int64[::1])


@njit(cache=True, nogil=True)
def put_row(
    i32: typed.List,
    i64: typed.List,
    row: int,
    ctx: np.ndarray,
    sa_tokens: np.ndarray,
    sa: np.ndarray,
    exact: np.ndarray,
    tree: np.ndarray,
    state: np.ndarray,
    rejected: np.ndarray,
) -> None:
    """Row ``row``'s arrays (a new row when ``row`` is the lists' end)."""
    if row * I32_PER_ROW == len(i32):
        for a in (ctx, sa_tokens, sa, exact, tree):
            i32.append(a)
        for b in (state, rejected):
            i64.append(b)
        return
    i32[row * I32_PER_ROW + CTX] = ctx
    i32[row * I32_PER_ROW + SA_TOKENS] = sa_tokens
    i32[row * I32_PER_ROW + SA] = sa
    i32[row * I32_PER_ROW + EXACT] = exact
    i32[row * I32_PER_ROW + TREE] = tree
    i64[row * I64_PER_ROW + STATE] = state
    i64[row * I64_PER_ROW + REJECTED_TABLE] = rejected


# Python reads and writes single arrays through these compiled calls: the typed list's own
# item access from Python compiles on first use in every process (a quarter second).


@njit(cache=True, nogil=True)
def get_i32(i32: typed.List, at: int) -> np.ndarray:
    return i32[at]


@njit(cache=True, nogil=True)
def get_i64(i64: typed.List, at: int) -> np.ndarray:
    return i64[at]


@njit(cache=True, nogil=True)
def put_i32(i32: typed.List, at: int, a: np.ndarray) -> None:
    i32[at] = a


@njit(cache=True, nogil=True)
def put_i64(i64: typed.List, at: int, a: np.ndarray) -> None:
    i64[at] = a


@njit(cache=True, nogil=True)
def write_tree(
    tree: np.ndarray,
    state: np.ndarray,
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    scores: np.ndarray,
) -> np.ndarray:
    """The session's last tree set to the given one (``tree``, or a larger array when it does
    not fit, is returned holding it)."""
    n = tokens.size
    c = tree.size // 4
    if n > c:
        c = max(n, 2 * c)
        tree = np.empty(4 * c, dtype=np.int32)
    bits = scores.view(np.int32)
    for i in range(n):
        tree[i] = tokens[i]
        tree[c + i] = parents[i]
        tree[2 * c + i] = sources[i]
        tree[3 * c + i] = bits[i]
    state[TREE_SIZE] = n
    return tree


@njit(cache=True, nogil=True)
def tree_views(tree: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The last tree's ``(tokens, parents, sources, scores)`` as views of its buffer (sources
    as int32, scores as float32)."""
    c = tree.size // 4
    return tree[:n], tree[c : c + n], tree[2 * c : 2 * c + n], tree[3 * c : 3 * c + n].view(np.float32)


@njit(cache=True, nogil=True)
def read_tree(tree: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The last tree's ``(tokens, parents, sources, scores)``, copied out."""
    tokens, parents, sources, scores = tree_views(tree, n)
    return tokens.copy(), parents.copy(), sources.astype(np.uint8), scores.copy()

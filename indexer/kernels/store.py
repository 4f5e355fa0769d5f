"""Where compiled steps find a session's arrays: by its row in a store of typed lists.

A session keeps its state in arrays (:mod:`indexer.session`); a namespace's store lists them by
row, so one compiled call reads and updates a whole batch of sessions in place. Per row the
int32 list holds :data:`I32_PER_ROW` arrays (context buffer, prompt index tokens and suffix
array, exact-prompt response) and the int64 list :data:`I64_PER_ROW` (state, rejected table).
"""

from __future__ import annotations

import numpy as np
from numba import njit, typed, types

# int32 arrays of a row, at row * I32_PER_ROW + ...
CTX, SA_TOKENS, SA, EXACT = range(4)
I32_PER_ROW = 4
# int64 arrays of a row, at row * I64_PER_ROW + ...
STATE, REJECTED_TABLE = range(2)
I64_PER_ROW = 2

# A session's state vector: context length, prompt length, tokens the prompt index covers, the
# last match lengths of the own-context and lifetime-suffix tiers (0: none), and how many
# generated tokens are known to equal the exact-prompt response's start (-1: they differ).
LEN, PROMPT_LEN, INDEXED, HINT_CTX, HINT_LIFE, EXACT_AGREES = range(6)
STATE_SIZE = 6

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
    state: np.ndarray,
    rejected: np.ndarray,
) -> None:
    """Row ``row``'s arrays (a new row when ``row`` is the lists' end)."""
    if row * I32_PER_ROW == len(i32):
        for a in (ctx, sa_tokens, sa, exact):
            i32.append(a)
        for b in (state, rejected):
            i64.append(b)
        return
    i32[row * I32_PER_ROW + CTX] = ctx
    i32[row * I32_PER_ROW + SA_TOKENS] = sa_tokens
    i32[row * I32_PER_ROW + SA] = sa
    i32[row * I32_PER_ROW + EXACT] = exact
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

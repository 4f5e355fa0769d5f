"""Prompt lookup decoding (vLLM's ``ngram`` proposer, transformers' ``prompt_lookup_num_tokens``):
the reference baseline and the client's local fallback drafter.

Find the longest n-gram (``max_n`` down to ``min_n``) ending the context that occurred earlier in
it and propose the ``num_tokens`` that followed its most recent earlier occurrence (the
occurrence nearest the end, as vLLM's ngram proposer does).
"""

from __future__ import annotations

import numpy as np

from indexer import kernels


def prompt_lookup(context: np.ndarray, *, min_n: int = 1, max_n: int = 3, num_tokens: int = 10) -> np.ndarray:
    """Draft chain for ``context`` (int32), empty if no n-gram repeats.

    >>> ctx = np.array([1, 2, 3, 4, 5, 1, 2, 3], dtype=np.int32)
    >>> prompt_lookup(ctx, num_tokens=3).tolist()  # "1 2 3" occurred at 0, followed by 4 5 1
    [4, 5, 1]
    >>> ctx = np.array([7, 1, 7, 2, 7], dtype=np.int32)
    >>> prompt_lookup(ctx, num_tokens=1).tolist()  # "7" occurred twice: the later one wins
    [2]
    >>> prompt_lookup(np.array([1, 2, 3], dtype=np.int32)).tolist()  # nothing repeats
    []
    """
    if min_n < 1 or max_n < min_n or num_tokens < 0:
        raise ValueError(f"need 1 <= min_n <= max_n and num_tokens >= 0, got {min_n}, {max_n}, {num_tokens}")
    start = kernels.prompt_lookup_start(np.ascontiguousarray(context, dtype=np.int32), min_n, max_n)
    if start < 0:
        return np.zeros(0, dtype=np.int32)
    return context[start : start + num_tokens].copy()


def prompt_lookup_match(context: np.ndarray, *, max_n: int = 3, num_tokens: int = 10) -> tuple[np.ndarray, int]:
    """:func:`prompt_lookup`'s chain (``min_n`` 1) and the length of the n-gram it matched (0:
    none), which says how far to trust it.

    One scan: the kernel tries the longest n-gram first, so no longer one ends the context just
    before the chain's start (it would have been found there), and the matched length is the
    longest that does.

    >>> ctx = np.array([1, 2, 3, 4, 5, 9, 2, 3], dtype=np.int32)
    >>> chain, n = prompt_lookup_match(ctx, num_tokens=2)
    >>> chain.tolist(), n  # "2 3" occurred before ("9 2 3" did not)
    ([4, 5], 2)
    """
    if max_n < 1 or num_tokens < 0:
        raise ValueError(f"need max_n >= 1 and num_tokens >= 0, got {max_n}, {num_tokens}")
    ctx = np.ascontiguousarray(context, dtype=np.int32)
    start = kernels.prompt_lookup_start(ctx, 1, max_n)
    if start < 0:
        return np.zeros(0, dtype=np.int32), 0
    n = next(n for n in range(min(max_n, start), 0, -1) if np.array_equal(ctx[start - n : start], ctx[ctx.size - n :]))
    return ctx[start : start + num_tokens].copy(), n

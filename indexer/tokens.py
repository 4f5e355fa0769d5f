"""Token-array validation: the one place where ids meet a vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Request separator inside buffers. It is larger than any valid id, so matches never cross it
# and it sorts consistently whether int32 values are compared signed or as big-endian bytes.
SEPARATOR = np.int32(np.iinfo(np.int32).max)
MAX_VOCAB_SIZE = int(SEPARATOR)


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """One tokenizer's id space. Nothing is shared across namespaces.

    >>> Namespace(name="llama2", vocab_size=32000).vocab_size
    32000
    """

    name: str
    vocab_size: int

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 128 or not self.name.isprintable():
            raise ValueError(f"namespace name must be 1-128 printable characters, got {self.name!r}")
        if not 1 <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {self.vocab_size}")


def one_tokenizer(a: int, b: int) -> bool:
    """Whether vocabularies of ``a`` and ``b`` ids may be one tokenizer's: the same size, or the
    larger a model's embedding table padded past its tokenizer (to a multiple of 64, at most a
    64th more: Qwen2.5's 151,665 tokenizer ids in 151,936 rows, Phi-3's 32,011 in 32,064). A
    size cannot tell every pair of tokenizers apart; it does tell most.

    >>> one_tokenizer(49152, 49152), one_tokenizer(151665, 151936), one_tokenizer(32064, 32011)
    (True, True, True)
    >>> one_tokenizer(32000, 32768), one_tokenizer(49152, 50257), one_tokenizer(100, 64)
    (False, False, False)
    """
    small, large = sorted((a, b))
    return small == large or (large % 64 == 0 and large - small <= large // 64)


def as_tokens(tokens: np.ndarray | Sequence[int], vocab_size: int, *, what: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a contiguous 1-D int32 array with every id in ``[0, vocab_size)``.

    Numpy input must already be int32 (a float or int64 array is a caller bug, not something to
    silently cast); a Python sequence of ints is converted.

    >>> as_tokens([1, 2, 3], 10).tolist()
    [1, 2, 3]
    >>> as_tokens([1, 10], 10)
    Traceback (most recent call last):
    ...
    ValueError: tokens: id 10 at position 1 is outside the vocabulary [0, 10)
    """
    if isinstance(tokens, np.ndarray):
        if tokens.dtype != np.int32:
            raise ValueError(f"{what}: expected dtype int32, got {tokens.dtype}")
        if tokens.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D array, got shape {tokens.shape}")
        arr = np.ascontiguousarray(tokens)
    else:
        if isinstance(tokens, (str, bytes)):
            raise ValueError(f"{what}: expected a sequence of ints, got {type(tokens).__name__}")
        if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) for t in tokens):
            raise ValueError(f"{what}: every id must be an int")
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except (OverflowError, ValueError) as exc:
            raise ValueError(f"{what}: ids must fit in int32") from exc
        if arr.ndim != 1:
            raise ValueError(f"{what}: expected a flat sequence")
    if arr.size and _outside(arr, vocab_size):
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{what}: id {int(arr[i])} at position {i} is outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int32, copy=False)


def _outside(arr: np.ndarray, vocab_size: int) -> bool:
    """Whether any id is outside ``[0, vocab_size)``. A decode step sends a few tokens per
    sequence, where Python's min and max are several times cheaper than numpy's reductions."""
    if arr.size <= 64:
        values = arr.tolist()
        return bool(min(values) < 0 or max(values) >= vocab_size)
    return bool(arr.min() < 0 or arr.max() >= vocab_size)  # two reductions, no temporaries

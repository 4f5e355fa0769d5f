"""Suffix array over a token snapshot, queried by the context's last tokens.

The index holds 8 bytes per token (the int32 tokens and the int32 suffix array); searches are
compiled binary searches (:mod:`indexer.kernels`). Requests are separated by
:data:`~indexer.tokens.SEPARATOR`, the largest int32, and the indexed tokens always end with one,
so no match or continuation runs across requests or off the end.
"""

from __future__ import annotations

import numpy as np

from indexer import kernels
from indexer.tokens import SEPARATOR


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes of ``tokens`` in lexicographic (signed int32) order, a
    suffix before any longer one it begins; suffixes equal up to and including a separator in
    text order (:func:`indexer.kernels.suffix_array`).

    >>> build_suffix_array(np.array([3, 1, 2, 1, 2], dtype=np.int32)).tolist()
    [3, 1, 4, 2, 0]
    """
    return kernels.suffix_array(np.ascontiguousarray(tokens, dtype=np.int32))


def extend_suffix_array(tokens: np.ndarray, old_sa: np.ndarray, dropped: int, new: int) -> np.ndarray:
    """:func:`build_suffix_array` of ``tokens`` from the suffix array of an older text, where
    ``tokens`` are that text less its first ``dropped`` tokens, then ``new`` appended tokens
    (:func:`indexer.kernels.merge_suffix_arrays`). Both parts must end with a separator.

    >>> S = int(SEPARATOR)
    >>> old = np.array([1, 2, S, 2, 1, S], dtype=np.int32)
    >>> text = np.array([2, 1, S, 1, 2, 2, S], dtype=np.int32)  # old[3:], then "1 2 2"
    >>> extend_suffix_array(text, build_suffix_array(old), 3, 4).tolist() == build_suffix_array(text).tolist()
    True
    """
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    base = tokens.size - new
    if new < 1 or base < 0 or dropped < 0 or old_sa.size - dropped != base:
        raise ValueError(f"{old_sa.size} old tokens less {dropped}, then {new} new, cannot make {tokens.size}")
    if tokens[-1] != SEPARATOR or (base > 0 and tokens[base - 1] != SEPARATOR):
        raise ValueError("the kept and the appended tokens must each end with a separator")
    # One set of argument types whatever the caller holds (see indexer.kernels.arrays): the
    # appended part sorted from a writable copy, the merge given read-only views.
    appended = kernels.suffix_array(np.array(tokens[base:]))
    old = kernels.read_only(old_sa, np.int32)
    return kernels.merge_suffix_arrays(kernels.read_only(tokens, np.int32), old, dropped, appended)


class SuffixIndex:
    """Longest-match lookups and continuation sampling over one immutable token array.

    >>> idx = SuffixIndex(np.array([5, 6, 7, 9, 5, 6, 8], dtype=np.int32))
    >>> idx.longest_match(np.array([1, 5, 6], dtype=np.int32), max_len=8)  # "5 6": SA rows 0-1
    (2, 0, 2)
    """

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray | None = None) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if tokens.size == 0 or tokens[-1] != SEPARATOR:
            if suffix_array is not None:
                raise ValueError("a prebuilt suffix array needs tokens ending with SEPARATOR")
            tokens = np.append(tokens, SEPARATOR)
        sa = build_suffix_array(tokens) if suffix_array is None else suffix_array
        if sa.dtype != np.int32 or sa.size != tokens.size:
            raise ValueError("suffix array must be int32 with one entry per token")
        self._tokens = tokens
        self._sa = sa

    @property
    def size(self) -> int:
        return int(self._sa.size)

    @property
    def nbytes(self) -> int:
        return int(self._tokens.nbytes + self._sa.nbytes)

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    @property
    def suffix_array(self) -> np.ndarray:
        return self._sa

    def match_range(self, pattern: np.ndarray) -> tuple[int, int]:
        """SA rows ``[first, last)`` whose suffixes start with the int32 ``pattern``."""
        return kernels.match_range(self._tokens, self._sa, pattern, 0, self.size)

    def longest_match(self, context: np.ndarray, max_len: int, min_len: int = 1, hint: int = 0) -> tuple[int, int, int]:
        """``(n, first, last)``: the longest ``n`` in ``[min_len, max_len]`` such that the last
        ``n`` context tokens occur in the index, with their SA rows. ``n == 0`` when none does.
        ``hint`` (the previous step's match plus the tokens accepted since) only saves work."""
        return kernels.longest_match(self._tokens, self._sa, context, max_len, max(min_len, 1), hint)

    def continuations(
        self, first: int, last: int, offset: int, depth: int, samples: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``samples`` continuations of the SA rows ``[first, last)``, ``offset`` tokens
        past each suffix start, as ``(rows, weights)``.

        Rows hold ``depth`` tokens padded with -1 from a request separator on. SA rows of one
        match are sorted by what follows, so evenly spaced samples keep identical continuations
        together and each sample stands for ``(last - first) / samples`` occurrences.
        """
        count = last - first
        if count <= 0 or depth <= 0:
            return np.zeros((0, max(depth, 0)), dtype=np.int32), np.zeros(0, dtype=np.float64)
        rows = kernels.sample_rows(self._tokens, self._sa, first, last, offset, depth, samples, int(SEPARATOR))
        return rows, np.full(rows.shape[0], count / rows.shape[0])

    def sample_starts(self, first: int, last: int, samples: int) -> np.ndarray:
        """Suffix start positions of up to ``samples`` evenly spaced SA rows in ``[first, last)``."""
        return kernels.sample_starts(self._sa, first, last, samples)

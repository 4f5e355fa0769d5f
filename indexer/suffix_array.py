"""Suffix array over a token snapshot, queried by the context's last tokens.

Lookups compare big-endian byte slices: for non-negative int32 ids, comparing their big-endian
bytes orders sequences exactly like comparing the ids, so each binary-search step is one C-level
``bytes`` comparison instead of a numpy call. The index holds 8 bytes per token: the byte copy of
the tokens and the int32 suffix array.
"""

from __future__ import annotations

import numpy as np

from indexer.tokens import SEPARATOR

try:  # the kept library; numpy prefix doubling is the slow fallback
    from pydivsufsort import divsufsort as _divsufsort
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    _divsufsort = None


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes of ``tokens`` in lexicographic order (int32).

    >>> build_suffix_array(np.array([3, 1, 2, 1, 2], dtype=np.int32)).tolist()
    [3, 1, 4, 2, 0]
    """
    if tokens.size == 0:
        return np.zeros(0, dtype=np.int32)
    if _divsufsort is not None:
        return np.asarray(_divsufsort(np.ascontiguousarray(tokens, dtype=np.int32)), dtype=np.int32)
    return suffix_array_numpy(tokens)


def suffix_array_numpy(tokens: np.ndarray) -> np.ndarray:
    """Prefix-doubling construction, O(n log^2 n); the fallback when pydivsufsort is absent."""
    n = tokens.size
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64) + 1
    k = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        second[: n - k] = rank[k:] if k < n else 0
        order = np.lexsort((second, rank))
        r, s = rank[order], second[order]
        changed = np.empty(n, dtype=bool)
        changed[0] = True
        changed[1:] = (r[1:] != r[:-1]) | (s[1:] != s[:-1])
        new_rank = np.empty(n, dtype=np.int64)
        new_rank[order] = np.cumsum(changed)
        rank = new_rank
        if changed.all() or k >= n:
            return order.astype(np.int32)
        k *= 2


class SuffixIndex:
    """Longest-match lookups and continuation sampling over one immutable token array.

    >>> idx = SuffixIndex(np.array([5, 6, 7, 9, 5, 6, 8], dtype=np.int32))
    >>> idx.longest_match(np.array([1, 5, 6], dtype=np.int32), max_len=8)
    (2, 0, 2)
    """

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray | None = None) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self._be = tokens.astype(">i4").tobytes()
        self._tokens = np.frombuffer(self._be, dtype=">i4")
        sa = build_suffix_array(tokens) if suffix_array is None else suffix_array
        if sa.dtype != np.int32 or sa.size != tokens.size:
            raise ValueError("suffix array must be int32 with one entry per token")
        self._sa = sa
        self._sa_view = memoryview(sa)  # indexing yields Python ints without numpy scalar cost

    @property
    def size(self) -> int:
        return int(self._sa.size)

    @property
    def nbytes(self) -> int:
        return len(self._be) + int(self._sa.nbytes)

    @property
    def tokens(self) -> np.ndarray:
        """The indexed tokens (read-only, big-endian int32 view)."""
        return self._tokens

    @property
    def suffix_array(self) -> np.ndarray:
        return self._sa

    def match_range(self, pattern: bytes, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """SA rows ``[first, last)`` whose suffixes start with ``pattern`` (big-endian bytes)."""
        be, sa, m = self._be, self._sa_view, len(pattern)
        end = self.size if hi is None else hi
        hi = end
        while lo < hi:
            mid = (lo + hi) >> 1
            s = sa[mid] << 2
            if be[s : s + m] < pattern:
                lo = mid + 1
            else:
                hi = mid
        if lo >= end or be[(sa[lo] << 2) : (sa[lo] << 2) + m] != pattern:
            return lo, lo  # nothing starts with the pattern: skip the upper-bound search
        first, hi = lo, end
        while lo < hi:
            mid = (lo + hi) >> 1
            s = sa[mid] << 2
            if be[s : s + m] <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def longest_match(
        self, context: np.ndarray, max_len: int, min_len: int = 1, hint: int = 0
    ) -> tuple[int, int, int]:
        """``(n, first, last)``: the longest ``n`` in ``[min_len, max_len]`` such that the last
        ``n`` context tokens occur in the index, with their SA rows. ``n == 0`` when none does.

        Matching is monotone (if the last ``n`` tokens occur, so do the last ``n - 1``), so a
        binary search over ``n`` needs ``O(log max_len)`` range searches. ``hint`` (typically the
        previous step's match plus the tokens accepted since) is probed first: when the match
        simply continued, two probes settle it.
        """
        hi_n = min(max_len, int(context.size))
        if hi_n < min_len or self.size == 0:
            return 0, 0, 0
        tail = context[-hi_n:].astype(">i4").tobytes()
        best = (0, 0, 0)
        lo_n = min_len - 1
        if min_len <= hint <= hi_n:
            first, last = self.match_range(tail[-4 * hint :])
            if first == last:
                hi_n = hint - 1
            else:
                lo_n, best = hint, (hint, first, last)
                if hint < hi_n:
                    first, last = self.match_range(tail[-4 * (hint + 1) :])
                    if first == last:
                        return best
                    lo_n, best = hint + 1, (hint + 1, first, last)
        while lo_n < hi_n:
            mid = (lo_n + hi_n + 1) >> 1
            first, last = self.match_range(tail[-4 * mid :])
            if first < last:
                lo_n, best = mid, (mid, first, last)
            else:
                hi_n = mid - 1
        return best

    def continuations(
        self, first: int, last: int, offset: int, depth: int, samples: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``samples`` continuations of the SA rows ``[first, last)``, ``offset`` tokens
        past each suffix start, as ``(rows, weights)``.

        Rows hold ``depth`` tokens padded with -1 after a request separator. SA rows of one match
        are sorted by what follows, so evenly spaced samples keep identical continuations
        together and each sample stands for ``(last - first) / samples`` occurrences.
        """
        count = last - first
        if count <= 0 or depth <= 0:
            return np.zeros((0, depth), dtype=np.int32), np.zeros(0, dtype=np.float64)
        starts = self.sample_starts(first, last, samples) + offset
        cols = starts[:, None] + np.arange(depth)
        past_end = cols >= self.size
        rows = self._tokens[np.minimum(cols, self.size - 1)].astype(np.int32)
        rows[np.logical_or.accumulate((rows == SEPARATOR) | past_end, axis=1)] = -1
        return rows, np.full(starts.size, count / starts.size)

    def sample_starts(self, first: int, last: int, samples: int) -> np.ndarray:
        """Suffix start positions of up to ``samples`` evenly spaced SA rows in ``[first, last)``."""
        count = last - first
        if count <= samples:
            picks = np.arange(first, last)
        else:
            picks = first + (np.arange(samples, dtype=np.int64) * count) // samples
        return self._sa[picks].astype(np.int64)

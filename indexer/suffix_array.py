"""Suffix array over a token snapshot, queried by the context's last tokens.

Lookups compare big-endian byte slices: for non-negative int32 ids, comparing their big-endian
bytes orders sequences exactly like comparing the ids, so each binary-search step is one C-level
``bytes`` comparison instead of a numpy call. The index holds 8 bytes per token: the byte copy of
the tokens and the int32 suffix array, plus a sampled key array (under 1 byte per token) that
narrows each binary search with one ``np.searchsorted`` before the byte comparisons start.
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
        if tokens.size == 0 or tokens[-1] != SEPARATOR:
            # A final separator: no match or continuation ever runs off the end.
            if suffix_array is not None:
                raise ValueError("a prebuilt suffix array needs tokens ending with SEPARATOR")
            tokens = np.append(tokens, SEPARATOR)
        self._be = tokens.astype(">i4").tobytes()
        self._tokens = np.frombuffer(self._be, dtype=">i4")
        sa = build_suffix_array(tokens) if suffix_array is None else suffix_array
        if sa.dtype != np.int32 or sa.size != tokens.size:
            raise ValueError("suffix array must be int32 with one entry per token")
        self._sa = sa
        self._sa_view = memoryview(sa)  # type: ignore[arg-type]  # indexing yields Python ints without numpy scalar cost
        self._keys = _SampledKeys(tokens, sa)

    @property
    def size(self) -> int:
        return int(self._sa.size)

    @property
    def nbytes(self) -> int:
        return len(self._be) + int(self._sa.nbytes) + self._keys.nbytes

    @property
    def tokens(self) -> np.ndarray:
        """The indexed tokens (read-only, big-endian int32 view)."""
        return self._tokens

    @property
    def suffix_array(self) -> np.ndarray:
        return self._sa

    def match_range(self, pattern: bytes, ids: list[int] | None = None) -> tuple[int, int]:
        """SA rows ``[first, last)`` whose suffixes start with ``pattern`` (big-endian bytes of
        the token ids ``ids``, which are decoded from it when not given)."""
        be, sa, m = self._be, self._sa_view, len(pattern)
        if ids is None:
            ids = np.frombuffer(pattern, dtype=">i4").tolist()
        lo, end = self._keys.bounds(ids)
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

    def longest_match(self, context: np.ndarray, max_len: int, min_len: int = 1, hint: int = 0) -> tuple[int, int, int]:
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
        ids = context[-hi_n:].tolist()
        best = (0, 0, 0)
        lo_n = min_len - 1
        if min_len <= hint <= hi_n:
            first, last = self.match_range(tail[-4 * hint :], ids[-hint:])
            if first == last:
                hi_n = hint - 1
            else:
                lo_n, best = hint, (hint, first, last)
                if hint < hi_n:
                    first, last = self.match_range(tail[-4 * (hint + 1) :], ids[-hint - 1 :])
                    if first == last:
                        return best
                    lo_n, best = hint + 1, (hint + 1, first, last)
        while lo_n < hi_n:
            mid = (lo_n + hi_n + 1) >> 1
            first, last = self.match_range(tail[-4 * mid :], ids[-mid:])
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
        cols = np.minimum(starts[:, None] + np.arange(depth), self.size - 1)  # the last token is a separator
        rows = self._tokens[cols].astype(np.int32)
        rows[np.logical_or.accumulate(rows == SEPARATOR, axis=1)] = -1
        return rows, np.full(starts.size, count / starts.size)

    def sample_starts(self, first: int, last: int, samples: int) -> np.ndarray:
        """Suffix start positions of up to ``samples`` evenly spaced SA rows in ``[first, last)``."""
        count = last - first
        if count <= samples:
            picks = np.arange(first, last)
        else:
            picks = first + (np.arange(samples, dtype=np.int64) * count) // samples
        return self._sa[picks].astype(np.int64)


class _SampledKeys:
    """Every ``step``-th suffix's first tokens packed into one uint64, in SA order.

    Tokens are coded ``id + 1`` (0 means "suffix ended") with the separator as the largest
    code, ``bits`` bits each, so integer order equals suffix order on the packed prefix.
    """

    def __init__(self, tokens: np.ndarray, sa: np.ndarray, step: int = 16) -> None:
        self.step = step
        real = tokens[tokens != SEPARATOR]
        top = int(real.max()) + 2 if real.size else 2  # codes 1..max+1, separator max+2
        self.bits = max(1, top.bit_length())
        self.width = max(1, min(8, 64 // self.bits))
        self._sep = top
        starts = sa[::step].astype(np.int64)
        key = np.zeros(starts.size, dtype=np.uint64)
        for j in range(self.width):
            pos = starts + j
            code = np.where(pos < tokens.size, tokens[np.minimum(pos, tokens.size - 1)].astype(np.int64) + 1, 0)
            code = np.where(code == int(SEPARATOR) + 1, self._sep, code)
            key = (key << np.uint64(self.bits)) | code.astype(np.uint64)
        self.keys = key
        self._view = memoryview(key)  # type: ignore[arg-type]  # Python-int indexing for the binary search
        self.size = int(sa.size)
        # Sampled keys per first-token code, so a search starts inside its first token's bucket.
        first_code = (key >> np.uint64(self.bits * (self.width - 1))).astype(np.int64)
        self._bucket = np.searchsorted(first_code, np.arange(top + 2)).tolist()

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes) + 8 * len(self._bucket)

    def bounds(self, ids: list[int]) -> tuple[int, int]:
        """A row range certain to contain every suffix starting with the tokens ``ids``."""
        keys, n = self._view, len(self._view)
        if n == 0:
            return 0, self.size
        bits, sep = self.bits, int(SEPARATOR)
        lo_key = hi_key = 0
        for j in range(self.width):
            if j < len(ids):
                code = self._sep if ids[j] == sep else ids[j] + 1
                if code > self._sep:  # an id never seen by this index: nothing can match
                    return 0, 0
                lo_key, hi_key = (lo_key << bits) | code, (hi_key << bits) | code
            else:  # the pattern ended: any continuation (codes 0 .. all ones) matches
                lo_key, hi_key = lo_key << bits, (hi_key << bits) | ((1 << bits) - 1)
        c0 = lo_key >> (bits * (self.width - 1))
        lo, hi = self._bucket[c0], self._bucket[c0 + 1]  # first sampled key >= lo_key
        top = hi
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] < lo_key:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, top  # first sampled key > hi_key
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] <= hi_key:
                lo = mid + 1
            else:
                hi = mid
        return max(0, (first - 1) * self.step), min(self.size, lo * self.step)

"""The successor tier's table: per token, the followers the target itself ranks highest after
it, learned from the top-k a decoder sees at every position it verifies (the adjacency idea of
Token Recycling, shared here by every request of a namespace).

A cache tier can only propose what was written before; the target's top-k also names what it
was about to write. At each verified position a decoder holds the target's distribution over
the next token anyway, so sending its top few ids back costs nothing and tells the cache, for
the token at that position, which tokens the target expects after it. Drafts chain those
followers (see :func:`~indexer.kernels.successors.successor_rows`).

>>> table = SuccessorTable(vocab_size=10)
>>> table.observe(np.array([3, 4], np.int32), np.array([[4, 7], [5, 1]], np.int32))
>>> table.followers_of(3)
[4, 7]
>>> table.size
2
"""

from __future__ import annotations

import threading

import numpy as np

from indexer.kernels.successors import successor_observe

MAX_TOPK = 8  # the most ids a decoder may send per verified position
DECAY = 0.9  # per observation of a token, the weight its earlier observations keep
# Chance that the target's greedy choice is the token it ranked r-th when the row was seen.
RANK_PROB = np.array([1.0, 0.3, 0.15, 0.1, 0.06, 0.04, 0.03, 0.02])


def checked_topk(topk: np.ndarray | list[list[int]], rows: int, vocab_size: int) -> np.ndarray:
    """``topk`` as ``rows`` rows of 1 to :data:`MAX_TOPK` int32 ids, each in the vocabulary or
    -1 (padding); ``ValueError`` otherwise.

    >>> checked_topk([[4, -1]], 1, 10).tolist()
    [[4, -1]]
    >>> checked_topk([[4], [5]], 1, 10)
    Traceback (most recent call last):
    ...
    ValueError: top-k must be 1 rows of 1 to 8 ids, got shape (2, 1)
    """
    ids = np.asarray(topk)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"top-k ids must be integers, got {ids.dtype}")
    if ids.ndim != 2 or ids.shape[0] != rows or not 1 <= ids.shape[1] <= MAX_TOPK:
        raise ValueError(f"top-k must be {rows} rows of 1 to {MAX_TOPK} ids, got shape {ids.shape}")
    bad = (ids < -1) | (ids >= vocab_size)
    if bad.any():
        raise ValueError(f"top-k id {int(ids[bad][0])} outside the vocabulary of {vocab_size}")
    return np.ascontiguousarray(ids, dtype=np.int32)


class SuccessorTable:
    """A namespace's successor table (dense, allocated on the first observation: ``vocab x
    MAX_TOPK`` followers and weights, 3.5 MB for a 49k vocabulary). Thread-safe."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self.followers = np.full((0, MAX_TOPK), -1, dtype=np.int32)
        self.weights = np.zeros((0, MAX_TOPK), dtype=np.float64)
        self.norm = np.zeros(0, dtype=np.float64)
        self._dirty = np.zeros(0, dtype=np.bool_)  # rows changed here since storage took them
        self.observations = 0

    @property
    def size(self) -> int:
        """Tokens with at least one follower."""
        return int(np.count_nonzero(self.norm > 0))

    def _allocate(self) -> None:
        if not self.norm.size:
            self.followers = np.full((self.vocab_size, MAX_TOPK), -1, dtype=np.int32)
            self.weights = np.zeros((self.vocab_size, MAX_TOPK), dtype=np.float64)
            self.norm = np.zeros(self.vocab_size, dtype=np.float64)
            self._dirty = np.zeros(self.vocab_size, dtype=np.bool_)

    def observe(self, prev: np.ndarray, rows: np.ndarray) -> None:
        """After token ``prev[i]`` (int32, in the vocabulary) the target's top-k was ``rows[i]``
        (int32, likeliest first, at most :data:`MAX_TOPK` ids; -1 pads). Callers check ids."""
        if not prev.size:
            return
        with self._lock:
            self._allocate()
            successor_observe(self.followers, self.weights, self.norm, prev, rows, DECAY, RANK_PROB)
            seen = prev[(prev >= 0) & (prev < self.vocab_size)]
            self._dirty[seen[rows[(prev >= 0) & (prev < self.vocab_size), 0] >= 0]] = True
            self.observations += int(prev.size)

    def kernel_args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(followers, weights, norm)`` as the draft step reads them (empty before any
        observation). Rows change in place under a running draft: a draft may read a row
        half updated, which costs at most a worse guess."""
        return self.followers, self.weights, self.norm

    def followers_of(self, token: int) -> list[int]:
        if not self.norm.size or self.norm[token] <= 0:
            return []
        return [int(f) for f in self.followers[token] if f >= 0]

    def take_changed(self) -> tuple[np.ndarray, list[bytes]]:
        """The rows changed since the last call, for storage: their tokens and each row packed
        (see :func:`pack_rows`). They count as stored from now on."""
        with self._lock:
            changed = np.flatnonzero(self._dirty).astype(np.int32)
            self._dirty[changed] = False
            return changed, pack_rows(self.followers[changed], self.weights[changed], self.norm[changed])

    def mark_changed(self, tokens: np.ndarray) -> None:
        """Rows :meth:`take_changed` gave out that storage did not take: given out again."""
        if tokens.size:
            with self._lock:
                self._dirty[tokens] = True

    def load(self, tokens: np.ndarray, packed: list[bytes]) -> int:
        """Rows read back from storage (:func:`pack_rows`) replace the rows of those tokens,
        except rows changed here since storage last took them. How many were taken."""
        followers, weights, norm = unpack_rows(packed)
        keep = (tokens >= 0) & (tokens < self.vocab_size)
        with self._lock:
            self._allocate()
            keep &= ~self._dirty[np.clip(tokens, 0, self.vocab_size - 1)]
            at = tokens[keep]
            self.followers[at] = np.where(followers[keep] < self.vocab_size, followers[keep], -1)
            self.weights[at] = weights[keep]
            self.norm[at] = norm[keep]
            return int(at.size)


_ROW = np.dtype([("followers", "<i4", (MAX_TOPK,)), ("weights", "<f4", (MAX_TOPK,)), ("norm", "<f4")])
ROW_BYTES = _ROW.itemsize  # 68


def pack_rows(followers: np.ndarray, weights: np.ndarray, norm: np.ndarray) -> list[bytes]:
    """Table rows as storage keeps them: per token, its followers (int32), their weights and
    its norm (float32), little-endian.

    >>> f, w, n = unpack_rows(pack_rows(np.array([[4] * 8], np.int32), np.full((1, 8), 0.5), np.ones(1)))
    >>> f[0, 0], w[0, 0], n[0], len(pack_rows(f, w, n)[0])
    (np.int32(4), np.float64(0.5), np.float64(1.0), 68)
    """
    rows = np.zeros(norm.size, dtype=_ROW)
    rows["followers"], rows["weights"], rows["norm"] = followers, weights, norm
    return [r.tobytes() for r in rows]


def unpack_rows(packed: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pack_rows` undone; ``ValueError`` for a row of the wrong size or with weights that
    are not finite and non-negative."""
    if any(len(p) != ROW_BYTES for p in packed):
        raise ValueError(f"a successor row is {ROW_BYTES} bytes")
    rows = np.frombuffer(b"".join(packed), dtype=_ROW)
    weights, norm = rows["weights"].astype(np.float64), rows["norm"].astype(np.float64)
    if not (np.isfinite(weights).all() and np.isfinite(norm).all() and (weights >= 0).all() and (norm >= 0).all()):
        raise ValueError("a successor row holds weights that are not finite and non-negative")
    return rows["followers"].astype(np.int32), weights, norm

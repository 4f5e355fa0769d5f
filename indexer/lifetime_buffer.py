"""The lifetime buffer: a fixed-capacity ring of every finished request's tokens.

Each request is stored followed by :data:`~indexer.tokens.SEPARATOR`, so a match found in a
snapshot never runs from one request into the next. When the ring is full the oldest tokens are
overwritten; a partly overwritten request simply loses its head.
"""

from __future__ import annotations

import threading

import numpy as np

from indexer.tokens import SEPARATOR


class LifetimeBuffer:
    """A thread-safe ring of int32 tokens with request separators.

    >>> buf = LifetimeBuffer(capacity=8)
    >>> buf.append(np.array([1, 2, 3], dtype=np.int32))
    >>> buf.append(np.array([4, 5], dtype=np.int32))
    >>> buf.snapshot().tolist() == [1, 2, 3, int(SEPARATOR), 4, 5, int(SEPARATOR)]
    True
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2 tokens, got {capacity}")
        self._ring = np.full(capacity, SEPARATOR, dtype=np.int32)
        self._head = 0  # next write position
        self._size = 0  # valid tokens in the ring
        self._appended = 0  # tokens ever written, separators included
        self._requests = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return int(self._ring.size)

    @property
    def size(self) -> int:
        return self._size

    @property
    def appended(self) -> int:
        """Tokens ever written (separators included): a monotonic version of the contents."""
        return self._appended

    @property
    def requests(self) -> int:
        return self._requests

    def append(self, tokens: np.ndarray) -> None:
        """Store one finished request. ``tokens`` must be validated int32 ids."""
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise ValueError("append expects a 1-D int32 array")
        cap = self._ring.size
        # A request longer than the ring keeps only its tail (and its separator).
        data = tokens[-(cap - 1) :] if tokens.size >= cap else tokens
        with self._lock:
            self._write(data)
            self._write(np.array([SEPARATOR], dtype=np.int32))
            self._requests += 1

    def _write(self, data: np.ndarray) -> None:
        cap = self._ring.size
        n = data.size
        first = min(n, cap - self._head)
        self._ring[self._head : self._head + first] = data[:first]
        if first < n:
            self._ring[: n - first] = data[first:]
        self._head = (self._head + n) % cap
        self._size = min(cap, self._size + n)
        self._appended += n

    def snapshot(self) -> np.ndarray:
        """A linear copy, oldest token first; later appends do not change it."""
        with self._lock:
            if self._size < self._ring.size:
                return self._ring[: self._size].copy()
            return np.concatenate((self._ring[self._head :], self._ring[: self._head]))

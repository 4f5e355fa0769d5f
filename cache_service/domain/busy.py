"""How busy drafting keeps a service process: the share of recent wall time its draft calls
took, each second weighing less than the one after it. Drafting ahead is work for spare time:
the service skips it while this share is high (``ServiceConfig.ahead_busy_limit``)."""

from __future__ import annotations

import math


class BusyShare:
    """The share of the last ``window_s`` seconds (exponentially weighted) spent in the spans
    :meth:`add` is given. At a steady share ``u`` of every second it reads ``u``.

    >>> b = BusyShare(window_s=1.0)
    >>> b.share(0.0)
    0.0
    >>> for t in range(100):  # 30 ms of every 100 ms, for 10 s
    ...     b.add(t / 10, t / 10 + 0.03)
    >>> round(b.share(10.0), 1)
    0.3
    >>> round(b.share(12.0), 2)  # two idle seconds later
    0.04
    """

    def __init__(self, window_s: float = 1.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._busy = 0.0  # weighted busy seconds, as of self._at
        self._at: float | None = None

    def _decay(self, now: float) -> None:
        if self._at is None or now < self._at:  # a clock that stepped back counts from now
            self._at = now
            return
        self._busy *= math.exp((self._at - now) / self.window_s)
        self._at = now

    def add(self, start: float, end: float) -> None:
        """A span of work from ``start`` to ``end`` (seconds on one monotonic clock)."""
        self._decay(end)
        self._busy += max(0.0, end - start)

    def share(self, now: float) -> float:
        """The busy share as of ``now``, in [0, 1]."""
        self._decay(now)
        return min(1.0, self._busy / self.window_s)

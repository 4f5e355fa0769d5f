"""The commit keys this replica's lifetime memory took lately, so a client's retry of a commit
is not taken twice where storage cannot tell (no storage, or the commit journaled).

A client that never got its close's answer commits the request again, under another session,
with the key it named the first commit with. Where the log answers, it says whether it held the
commit already (:class:`~cache_service.domain.ports.Committed`); a retry the replica could only
journal, or one to a service without storage, is checked here. So is a retry of a commit that
landed on another replica, which this memory took from the log before the retry reached it:
the keys of what it takes from the log are recorded too. Bounded: the oldest keys go.

>>> recent = RecentKeys(most=2)
>>> recent.first("ns", "a" * 16), recent.first("ns", "a" * 16), recent.first("ns", "")
(True, False, True)
>>> _ = recent.first("ns", "b" * 16), recent.first("ns", "c" * 16)
>>> recent.first("ns", "a" * 16)  # forgotten for the newer ones
True
>>> recent.took("ns", ["d" * 16, "e" * 16, "f" * 16])  # from the log: the newest two kept
>>> recent.first("ns", "f" * 16), recent.first("ns", "d" * 16)
(False, True)
"""

from __future__ import annotations

import threading
from collections import OrderedDict

RECENT_KEYS = 1 << 14  # keys remembered, the fleet's commits included: a client retries within seconds


class RecentKeys:
    """At most ``most`` ``(namespace, key)`` pairs, the newest kept; safe on any thread."""

    def __init__(self, most: int = RECENT_KEYS) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self._most = most
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def took(self, namespace: str, keys: list[str]) -> None:
        """Record ``keys`` as taken (commits the memory took from the log), the newest last."""
        with self._lock:
            for key in keys[-self._most :]:
                self._keys[(namespace, key)] = None
                self._keys.move_to_end((namespace, key))
            while len(self._keys) > self._most:
                self._keys.popitem(last=False)

    def first(self, namespace: str, key: str) -> bool:
        """Whether the memory may take a commit of ``key`` in ``namespace``: it has none (""),
        or one not taken lately (now recorded as taken)."""
        if not key:
            return True
        with self._lock:
            if (namespace, key) in self._keys:
                return False
            self._keys[(namespace, key)] = None
            if len(self._keys) > self._most:
                self._keys.popitem(last=False)
            return True

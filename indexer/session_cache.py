"""Session-scoped LRU leader -> follower tables (DOUBLE's rejected cache).

A *leader* is the ``leader_len`` tokens before a position; its *followers* are the
``follower_len`` tokens seen after it. Both levels are LRU by update: adding to a leader (or
seeing a follower again) refreshes it, and the least recently updated leader (or follower of one
leader) goes first when a capacity is reached. Lookups do not reorder anything, so a table is a
pure function of what was added to it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

Leader = tuple[int, ...]
Follower = tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class LruTableConfig:
    leader_len: int = 2
    follower_len: int = 8
    max_leaders: int = 8192
    max_followers: int = 4

    def __post_init__(self) -> None:
        for name in ("leader_len", "follower_len", "max_leaders", "max_followers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class LruTable:
    """Bounded leader -> followers map with per-follower hit counts.

    >>> t = LruTable(LruTableConfig(leader_len=1, follower_len=2, max_leaders=2, max_followers=2))
    >>> t.add((1,), (2, 3)); t.add((1,), (2, 4)); t.add((1,), (2, 3))
    >>> t.followers((1,))  # most recent first, with counts
    [((2, 3), 2), ((2, 4), 1)]
    """

    def __init__(self, config: LruTableConfig) -> None:
        self.config = config
        self._table: OrderedDict[Leader, OrderedDict[Follower, int]] = OrderedDict()
        self.version = 0  # changes with every add (what was saved is told apart from what was not)

    def __len__(self) -> int:
        return len(self._table)

    def add(self, leader: Leader, follower: Follower, count: int = 1) -> None:
        self.version += 1
        followers = self._table.get(leader)
        if followers is None:
            followers = self._table[leader] = OrderedDict()
            if len(self._table) > self.config.max_leaders:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(leader)
        followers[follower] = followers.pop(follower, 0) + count
        if len(followers) > self.config.max_followers:
            followers.popitem(last=False)

    def followers(self, leader: Leader) -> list[tuple[Follower, int]]:
        followers = self._table.get(leader)
        if followers is None:
            return []
        return list(reversed(followers.items()))

    def items(self) -> list[tuple[Leader, list[tuple[Follower, int]]]]:
        """Oldest leader first, each with its followers oldest first (replayable by ``add``)."""
        return [(lead, list(fol.items())) for lead, fol in self._table.items()]

    def candidates(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Followers of the context's last ``leader_len`` tokens as ``(rows, weights)``, or
        ``None`` when the leader is unknown."""
        ll, fl = self.config.leader_len, self.config.follower_len
        if not self._table or context.size < ll:  # most steps: nothing rejected yet
            return None
        found = self.followers(tuple(context[-ll:].tolist()))
        if not found:
            return None
        rows = np.full((len(found), fl), -1, dtype=np.int32)
        for i, (fol, _) in enumerate(found):
            rows[i, : len(fol)] = fol
        return rows, np.array([c for _, c in found], dtype=np.float64)


class RejectedCache:
    """Branches the target rejected, keyed by the context tail where they branched off.

    >>> cache = RejectedCache(LruTableConfig(leader_len=1, follower_len=3))
    >>> cache.record(np.array([5, 6], dtype=np.int32), np.array([9, 9, 9, 9], dtype=np.int32))
    >>> cache.table.followers((6,))
    [((9, 9, 9), 1)]
    """

    def __init__(self, config: LruTableConfig) -> None:
        self.table = LruTable(config)

    def record(self, context: np.ndarray, branch: np.ndarray) -> None:
        self.record_at(context, [(context.size, branch)])

    def record_followers(self, tokens: np.ndarray, end: int, followers: Iterable[tuple[int, ...]]) -> None:
        """:meth:`record_at` for branches that all leave after ``tokens[:end]``, given as
        tuples already cut to ``follower_len`` (as verification outcomes come)."""
        ll = self.table.config.leader_len
        if end < ll:
            return
        leader = tuple(tokens[end - ll : end].tolist())
        for follower in followers:
            if follower:
                self.table.add(leader, follower)

    def record_at(self, tokens: np.ndarray, branches: Iterable[tuple[int, np.ndarray]]) -> None:
        """:meth:`record` for each ``(end, branch)``: a branch rejected after ``tokens[:end]``.
        Branches that leave at the same place (a step's usually do) share one leader."""
        fl = self.table.config.follower_len
        for end, same_place in itertools.groupby(branches, key=lambda branch: branch[0]):
            self.record_followers(tokens, end, [tuple(b[:fl].tolist()) for _, b in same_place])

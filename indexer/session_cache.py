"""Session-scoped LRU leader -> follower tables (DOUBLE's rejected cache).

A *leader* is the ``leader_len`` tokens before a position; its *followers* are the
``follower_len`` tokens seen after it. Both levels are LRU by update: adding to a leader (or
seeing a follower again) refreshes it, and the least recently updated leader (or follower of one
leader) goes first when a capacity is reached. Lookups do not reorder anything, so a table is a
pure function of what was added to it.

The table lives in one int64 array (:mod:`indexer.kernels.lru`), so the compiled draft and
accept steps read and update a batch's tables in place, with no interpreter work per session.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from indexer.kernels import lru

Leader = tuple[int, ...]
Follower = tuple[int, ...]
TableItems = list[tuple[Leader, list[tuple[Follower, int]]]]  # LruTable.items()
_INT32_MAX = 2**31 - 1


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


def _ids(tokens: Sequence[int], what: str) -> np.ndarray:
    out = np.asarray(tokens, dtype=np.int64)
    if out.ndim != 1 or (out.size and (int(out.min()) < 0 or int(out.max()) > _INT32_MAX)):
        raise ValueError(f"{what} must be token ids in [0, 2**31), got {tuple(tokens)}")
    return out


@dataclass(frozen=True, eq=False)
class TableColumns:
    """A table's entries as flat columns (the layout storage writes): per leader its length and
    its number of followers, per follower its length and count, then the leaders' tokens and the
    followers' tokens end to end. Least recently updated leader first, each leader's followers
    oldest first, so adding them in order rebuilds the table, recency included.

    >>> TableColumns.of_items([((1, 2), [((3, 4), 2), ((5,), 1)])]).follower_tokens.tolist()
    [3, 4, 5]
    """

    leader_lens: np.ndarray
    fanout: np.ndarray
    follower_lens: np.ndarray
    counts: np.ndarray
    leader_tokens: np.ndarray
    follower_tokens: np.ndarray

    @classmethod
    def of_items(cls, items: Iterable[tuple[Sequence[int], Sequence[tuple[Sequence[int], int]]]]) -> TableColumns:
        leader_lens: list[int] = []
        fanout: list[int] = []
        follower_lens: list[int] = []
        counts: list[int] = []
        leader_tokens: list[int] = []
        follower_tokens: list[int] = []
        for leader, followers in items:
            leader_lens.append(len(leader))
            leader_tokens.extend(leader)
            fanout.append(len(followers))
            for follower, count in followers:
                follower_lens.append(len(follower))
                follower_tokens.extend(follower)
                counts.append(count)
        cols = (leader_lens, fanout, follower_lens, counts, leader_tokens, follower_tokens)
        return cls(*(np.array(c, dtype=np.int64) for c in cols))

    def __len__(self) -> int:
        return int(self.leader_lens.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TableColumns):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _COLUMNS)

    __hash__ = None  # type: ignore[assignment]  # equal by value, and its arrays are mutable

    def items(self) -> TableItems:
        """Oldest leader first, each with its followers oldest first (replayable by ``add``)."""
        lt, ft, f = 0, 0, 0
        leader_tokens, follower_tokens = self.leader_tokens.tolist(), self.follower_tokens.tolist()
        follower_lens, counts = self.follower_lens.tolist(), self.counts.tolist()
        out: TableItems = []
        for n_lead, n_fol in zip(self.leader_lens.tolist(), self.fanout.tolist(), strict=True):
            followers = []
            for length, count in zip(follower_lens[f : f + n_fol], counts[f : f + n_fol], strict=True):
                followers.append((tuple(follower_tokens[ft : ft + length]), count))
                ft += length
            out.append((tuple(leader_tokens[lt : lt + n_lead]), followers))
            lt += n_lead
            f += n_fol
        return out


_COLUMNS = ("leader_lens", "fanout", "follower_lens", "counts", "leader_tokens", "follower_tokens")


class LruTable:
    """Bounded leader -> followers map with per-follower hit counts.

    >>> t = LruTable(LruTableConfig(leader_len=1, follower_len=2, max_leaders=2, max_followers=2))
    >>> t.add((1,), (2, 3)); t.add((1,), (2, 4)); t.add((1,), (2, 3))
    >>> t.followers((1,))  # most recent first, with counts
    [((2, 3), 2), ((2, 4), 1)]
    """

    def __init__(self, config: LruTableConfig) -> None:
        self.config = config
        self.array = lru.new_table(config.leader_len, config.follower_len, config.max_followers, config.max_leaders)

    def __len__(self) -> int:
        return int(self.array[lru.N])

    @property
    def version(self) -> int:
        """Changes with every add (what was saved is told apart from what was not)."""
        return int(self.array[lru.VERSION])

    def add(self, leader: Leader, follower: Follower, count: int = 1) -> None:
        """Count ``follower`` (cut to ``follower_len``) after ``leader`` (``leader_len`` ids)."""
        key, fol = _ids(leader, "a leader"), _ids(follower, "a follower")
        if key.size != self.config.leader_len:
            raise ValueError(f"a leader has {self.config.leader_len} tokens, got {tuple(leader)}")
        if not fol.size:
            raise ValueError("a follower needs at least one token")
        self._add(key, fol, count)

    def _add(self, key: np.ndarray, fol: np.ndarray, count: int) -> None:
        added = lru.add(self.array, key, 0, fol, 0, fol.size, count)
        # The same array comes back (as another ndarray object) unless the table grew; keeping
        # the object tells a holder of it (a session store) that nothing was replaced.
        if added.size != self.array.size:
            self.array = added

    def followers(self, leader: Leader) -> list[tuple[Follower, int]]:
        """Most recent first."""
        key = _ids(leader, "a leader")
        if key.size != self.config.leader_len:
            return []
        slot = lru.find(self.array, key, 0)
        return [] if slot < 0 else _listed(*lru.followers_at(self.array, slot, True))

    def items(self) -> TableItems:
        """Oldest leader first, each with its followers oldest first (replayable by ``add``)."""
        return self.columns().items()

    def columns(self) -> TableColumns:
        """:meth:`items` as flat columns, read in one compiled pass."""
        return TableColumns(*lru.columns(self.array))

    def candidates(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Followers of the context's last ``leader_len`` tokens as ``(rows, weights)``, or
        ``None`` when the leader is unknown."""
        rows, weights = lru.candidates(self.array, np.ascontiguousarray(context, dtype=np.int32))
        return (rows, weights) if rows.shape[0] else None


def _listed(rows: np.ndarray, lengths: np.ndarray, counts: np.ndarray) -> list[tuple[Follower, int]]:
    return [(tuple(row[:n]), c) for row, n, c in zip(rows.tolist(), lengths.tolist(), counts.tolist(), strict=True)]


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
        leader = np.ascontiguousarray(tokens[end - ll : end], dtype=np.int64)
        for follower in followers:
            if follower:
                self.table._add(leader, np.array(follower, dtype=np.int64), 1)

    def record_at(self, tokens: np.ndarray, branches: Iterable[tuple[int, np.ndarray]]) -> None:
        """:meth:`record` for each ``(end, branch)``: a branch rejected after ``tokens[:end]``.
        Branches that leave at the same place (a step's usually do) share one leader."""
        fl = self.table.config.follower_len
        for end, same_place in itertools.groupby(branches, key=lambda branch: branch[0]):
            self.record_followers(tokens, end, [tuple(b[:fl].tolist()) for _, b in same_place])

"""Frozen leader -> follower tables (Cacheback's frozen table, built from a suffix array).

For a leader (the last ``leader_len`` context tokens) the table keeps the ``top_k`` followers of
``follower_len`` tokens that maximise the expected accepted length, ``sum_j P(f[:j] | leader)``,
with those prefix probabilities stored beside them. Building from a suffix array makes this
exact and cheap: rows of the array sorted by suffix put every leader's occurrences together and,
within a leader, every follower prefix together, so all prefix counts are run lengths of the LCP
array.

Tables are immutable once built; ``to_bytes`` / ``from_bytes`` move them through storage.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from indexer import kernels
from indexer.suffix_array import build_suffix_array
from indexer.tokens import SEPARATOR


@dataclass(frozen=True, kw_only=True)
class NgramTableConfig:
    """Shape of one frozen table.

    ``max_leaders`` bounds memory: only the most frequent leaders are kept.
    """

    leader_len: int = 3
    follower_len: int = 8
    top_k: int = 4
    min_count: int = 2
    max_leaders: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("leader_len", "follower_len", "top_k", "min_count", "max_leaders"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.leader_len > 16 or self.follower_len > 64:
            raise ValueError("leader_len must be <= 16 and follower_len <= 64")


def leader_hash(tokens: np.ndarray) -> int:
    """64-bit hash of one leader (int32 tokens); equals :func:`leader_hashes` on the same row."""
    return int(kernels.hash_tokens(np.ascontiguousarray(tokens, dtype=np.int32), 0, tokens.size))


def leader_hashes(mat: np.ndarray) -> np.ndarray:
    """Row-wise :func:`leader_hash` of a ``(rows, leader_len)`` int32 matrix."""
    return kernels.hash_rows(np.ascontiguousarray(mat, dtype=np.int32))


def with_final_separator(tokens: np.ndarray) -> np.ndarray:
    """``tokens`` ending with one ``SEPARATOR`` (appended if missing)."""
    if tokens.size and tokens[-1] == SEPARATOR:
        return tokens
    return np.append(tokens, SEPARATOR).astype(np.int32)


def lcp_array(tokens: np.ndarray, sa: np.ndarray) -> np.ndarray:
    """``lcp[i]`` = common prefix length of suffixes ``sa[i-1]`` and ``sa[i]`` (``lcp[0] = 0``)."""
    return kernels.lcp(np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(sa, dtype=np.int32))


class NgramTable:
    """Immutable leader -> top followers table.

    >>> toks = np.array([1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5], dtype=np.int32)
    >>> table = NgramTable.build(toks, NgramTableConfig(leader_len=2, follower_len=2, top_k=2))
    >>> rows, probs, count = table.lookup(np.array([7, 1, 2], dtype=np.int32))
    >>> rows.tolist(), count  # "1 2" was followed by "3 4" twice and "3 5" once
    ([[3, 4], [3, 5]], 3)
    """

    def __init__(
        self,
        config: NgramTableConfig,
        keys: np.ndarray,
        offsets: np.ndarray,
        leader_counts: np.ndarray,
        followers: np.ndarray,
        probs: np.ndarray,
    ) -> None:
        self.config = config
        self._keys = keys
        self._offsets = offsets
        self._leader_counts = leader_counts
        self._followers = followers
        self._probs = probs

    @property
    def leaders(self) -> int:
        return int(self._keys.size)

    @property
    def entries(self) -> int:
        return int(self._followers.shape[0])

    @property
    def nbytes(self) -> int:
        arrays = (self._keys, self._offsets, self._leader_counts, self._followers, self._probs)
        return sum(int(a.nbytes) for a in arrays)

    def lookup(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Followers of the context's last ``leader_len`` tokens: ``(rows, probs, count)``.

        ``rows`` is ``(k, follower_len)`` int32 padded with -1; ``probs[r, j]`` is the estimated
        probability that the first ``j + 1`` tokens of row ``r`` follow; ``count`` is how often
        the leader occurred. ``None`` when the leader is unknown.
        """
        i = kernels.find_leader(context, self.config.leader_len, self._keys)
        return None if i < 0 else self.entry(i)

    def entry(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Followers, prefix probabilities and count of the ``i``-th leader (hash order)."""
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._followers[lo:hi], self._probs[lo:hi], int(self._leader_counts[i])

    @property
    def keys(self) -> np.ndarray:
        """Leader hashes, ascending."""
        return self._keys

    def check_vocab(self, vocab_size: int) -> None:
        """``ValueError`` unless every follower id is in ``[0, vocab_size)`` (``-1`` pads short
        followers). Leaders are kept as hashes only: one holding an id outside the vocabulary
        never matches a context (contexts hold none), so followers are what could be served.

        >>> toks = np.array([1, 2, 3, 1, 2, 3], dtype=np.int32)
        >>> table = NgramTable.build(toks, NgramTableConfig(leader_len=1, follower_len=2))
        >>> table.check_vocab(4)
        >>> table.check_vocab(3)
        Traceback (most recent call last):
        ...
        ValueError: follower id 3 is outside the vocabulary [0, 3)
        """
        followers = self._followers
        if not followers.size:
            return
        low, high = int(followers.min()), int(followers.max())  # two passes, no copy (mapped pages too)
        if low < -1 or high >= vocab_size:
            bad = low if low < -1 else high
            raise ValueError(f"follower id {bad} is outside the vocabulary [0, {vocab_size})")

    def search_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(keys, offsets, followers, probability bits)`` for compiled lookups: leader ``i``'s
        followers are rows ``[offsets[i], offsets[i + 1])``, their float16 probabilities given
        as ``uint16`` bits."""
        return self._keys, self._offsets, self._followers, self._probs.view(np.uint16)

    @classmethod
    def build(cls, tokens: np.ndarray, config: NgramTableConfig) -> NgramTable:
        """Build from int32 tokens (requests separated by ``SEPARATOR``)."""
        tokens = with_final_separator(tokens)
        sa = build_suffix_array(tokens)
        return cls.build_from_suffix_array(tokens, sa, lcp_array(tokens, sa), config)

    @classmethod
    def build_from_suffix_array(
        cls, tokens: np.ndarray, sa: np.ndarray, lcp: np.ndarray, config: NgramTableConfig
    ) -> NgramTable:
        """Build reusing a suffix array and its LCP array (see :func:`lcp_array`) of ``tokens``,
        which must end with ``SEPARATOR`` (the end of the text then ends a follower exactly as
        a request boundary does)."""
        ll, fl = config.leader_len, config.follower_len
        if tokens.size == 0:
            return cls._empty(config)
        if tokens[-1] != SEPARATOR:
            raise ValueError("tokens must end with SEPARATOR (see with_final_separator)")
        flen = kernels.follower_lengths(tokens, sa, ll, fl, int(SEPARATOR))
        firsts, lead_count = kernels.leader_runs(lcp, flen, ll)  # leaders: runs of SA rows
        kept = np.flatnonzero(cls._kept_leaders(lead_count, config))
        if kept.size == 0:
            return cls._empty(config)
        runs, starts, lens, counts = kernels.table_entries(lcp, flen, sa, firsts, kept, ll, fl, config.top_k)
        if starts.size == 0:
            return cls._empty(config)
        return cls._assemble(tokens, starts, lead_count[runs].astype(np.int64), counts, lens, config)

    @staticmethod
    def _kept_leaders(lead_count: np.ndarray, config: NgramTableConfig) -> np.ndarray:
        """Leaders seen at least ``min_count`` times; past ``max_leaders`` of them, the most
        frequent, ties to the lexicographically smaller leader (the earlier run)."""
        keep = lead_count >= config.min_count
        n = int(keep.sum())
        if n <= config.max_leaders:
            return keep
        cut = int(np.partition(lead_count[keep], n - config.max_leaders)[n - config.max_leaders])
        above = keep & (lead_count > cut)  # fewer than max_leaders, with those at the cut: enough
        ties = np.flatnonzero(keep & (lead_count == cut))[: config.max_leaders - int(above.sum())]
        above[ties] = True
        return above

    @classmethod
    def _assemble(
        cls,
        tokens: np.ndarray,
        starts: np.ndarray,
        totals: np.ndarray,
        counts: np.ndarray,
        flen: np.ndarray,
        config: NgramTableConfig,
    ) -> NgramTable:
        """The table from its entries: per entry a suffix start of its leader, the leader's
        count, its prefix counts and follower length; a leader's entries together, best first."""
        ll, fl = config.leader_len, config.follower_len
        leaders = tokens[starts[:, None] + np.arange(ll)]
        keys = leader_hashes(leaders)
        cols = starts[:, None] + ll + np.arange(fl)
        followers = tokens[np.minimum(cols, tokens.size - 1)].astype(np.int32)
        followers[np.arange(fl)[None, :] >= flen[:, None]] = -1
        probs = (counts / totals[:, None].astype(np.float32)).astype(np.float16)
        # Group by key (hash order) keeping the per-leader score order inside each group.
        order = np.lexsort((np.arange(starts.size), keys))
        keys, totals = keys[order], totals[order]
        first = np.concatenate(([True], keys[1:] != keys[:-1]))
        offsets = np.append(np.flatnonzero(first), keys.size).astype(np.int64)
        return cls(config, keys[first], offsets, totals[first], followers[order], probs[order])

    @classmethod
    def _empty(cls, config: NgramTableConfig) -> NgramTable:
        fl = config.follower_len
        return cls(
            config,
            np.zeros(0, dtype=np.uint64),
            np.zeros(1, dtype=np.int64),
            np.zeros(0, dtype=np.int64),
            np.zeros((0, fl), dtype=np.int32),
            np.zeros((0, fl), dtype=np.float16),
        )

    ARRAYS = ("keys", "offsets", "leader_counts", "followers", "probs")

    def arrays(self) -> dict[str, np.ndarray]:
        """The table's arrays by name (with :meth:`from_arrays`, a zero-copy round trip)."""
        return dict(
            zip(
                self.ARRAYS, (self._keys, self._offsets, self._leader_counts, self._followers, self._probs), strict=True
            )
        )

    def to_bytes(self) -> bytes:
        """Serialise to an ``.npz`` blob (CRC-checked on load)."""
        buf = io.BytesIO()
        c = self.config
        shape = np.array([c.leader_len, c.follower_len, c.top_k, c.min_count, c.max_leaders], np.int64)
        np.savez(buf, shape=shape, **self.arrays())  # type: ignore[arg-type]
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> NgramTable:
        """Inverse of :meth:`to_bytes`; raises ``ValueError`` on a corrupt or foreign blob."""
        try:
            with np.load(io.BytesIO(blob), allow_pickle=False) as z:
                ll, fl, k, mc, ml = (int(v) for v in z["shape"])
                config = NgramTableConfig(leader_len=ll, follower_len=fl, top_k=k, min_count=mc, max_leaders=ml)
                arrays = {name: z[name] for name in cls.ARRAYS}
        except Exception as exc:  # zipfile, KeyError, bad header: all mean "not our table"
            raise ValueError(f"corrupt n-gram table blob: {exc}") from exc
        return cls.from_arrays(config, arrays)

    @classmethod
    def from_arrays(cls, config: NgramTableConfig, arrays: dict[str, np.ndarray]) -> NgramTable:
        """A table over given arrays (no copy); ``ValueError`` if they are inconsistent."""
        keys, offsets, counts, followers, probs = (arrays[name] for name in cls.ARRAYS)
        if (
            keys.dtype != np.uint64
            or keys.ndim != 1
            or offsets.size != keys.size + 1
            or counts.shape != keys.shape
            or (keys.size > 1 and bool(np.any(keys[1:] <= keys[:-1])))
            or int(offsets[0]) != 0
            or bool(np.any(np.diff(offsets) < 1))
            or probs.dtype != np.float16
            or followers.shape != probs.shape
            or followers.ndim != 2
            or followers.shape[1] != config.follower_len
            or (offsets.size and int(offsets[-1]) != followers.shape[0])
            or followers.dtype != np.int32
        ):
            raise ValueError("corrupt n-gram table blob: inconsistent arrays")
        return cls(config, keys, offsets, counts, followers, probs)

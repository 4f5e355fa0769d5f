"""Merge candidate continuations from every tier into one budgeted draft tree.

Each tier hands over rows of continuation tokens with, per position, the estimated probability
that the row's prefix up to there is what the target generates. Rows from all tiers become one
trie; a node's score is the sum over tiers of that tier's best estimate for the node (tiers that
agree reinforce each other). Scores never grow along a path, so the ``budget`` best nodes form a
valid tree with every parent kept: that is best-first growth from the root, and it sizes the tree
by confidence (a weak match yields a few nodes above ``min_score``, a strong one a long chain).
A depth reserve keeps the best chain's first ``depth_reserve`` nodes even when wide, shallow
alternatives score higher, so one confident long path is never crowded out.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, overload

import numpy as np

from indexer import kernels


class Tier(enum.IntEnum):
    """Where a draft node came from (on the wire as a small int)."""

    DYNAMIC = 0  # session LRU leader -> followers
    CONTEXT = 1  # the request's own prompt and output
    REJECTED = 2  # branches the target rejected earlier in the session
    LIFETIME_SA = 3  # suffix array over every finished request
    LIFETIME_NGRAM = 4  # frozen n-gram table over the same buffer
    PRIOR = 5  # static prior warmed from a corpus
    EXACT = 6  # the previous response to an identical prompt
    SUCCESSOR = 7  # the target's own likeliest followers, from the top-k decoders send back


_N_TIERS = len(Tier)


@dataclass(slots=True)
class Candidates:
    """One tier's proposals: ``rows`` (R, D) int32 padded with -1, scaled by ``confidence``.

    Either ``weights`` (R,): occurrence counts, a node's probability being the weight share of
    the tier's rows through it; or ``probs`` (R, D): per-prefix probabilities computed upstream
    (frozen tables), a node taking the best of its rows.

    Treated as a value once made (several per draft, so plain slots rather than a frozen
    dataclass, whose ``__init__`` costs several times more).
    """

    tier: Tier
    rows: np.ndarray
    weights: np.ndarray | None = None
    probs: np.ndarray | None = None
    confidence: float = 1.0

    def __post_init__(self) -> None:
        if (self.weights is None) == (self.probs is None):
            raise ValueError("give exactly one of weights or probs")


class TreeBatch(NamedTuple):
    """Trees drafted together, stored end to end: tree ``j`` is ``[offsets[j], offsets[j + 1])``
    of each array (what the batch draft step returns)."""

    tokens: np.ndarray  # int32
    parents: np.ndarray  # int32
    sources: np.ndarray  # uint8
    scores: np.ndarray  # float32
    offsets: np.ndarray  # int64 (trees + 1,)


@dataclass(frozen=True)
class DraftTree:
    """A draft tree in wire order: parents precede children, -1 is the context's last token.

    >>> t = DraftTree.chain(np.array([7, 8], dtype=np.int32))
    >>> t.parents.tolist(), t.depths().tolist()
    ([-1, 0], [1, 2])
    """

    tokens: np.ndarray  # int32 (n,)
    parents: np.ndarray  # int32 (n,)
    sources: np.ndarray  # uint8 (n,) Tier values
    scores: np.ndarray  # float32 (n,) estimated probability that the node is accepted
    # The batch the tree was drafted in and its place there (its arrays are views of the
    # batch's), so that trees of one batch are read or sent together without being joined.
    batch: TreeBatch | None = field(default=None, compare=False, repr=False)
    row: int = field(default=-1, compare=False, repr=False)

    @classmethod
    def empty(cls) -> DraftTree:
        z = np.zeros(0, dtype=np.int32)
        return cls(z, z.copy(), np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.float32))

    @classmethod
    def chain(cls, tokens: np.ndarray, tier: Tier = Tier.CONTEXT) -> DraftTree:
        n = tokens.size
        return cls(
            tokens.astype(np.int32),
            np.arange(-1, n - 1, dtype=np.int32),
            np.full(n, tier, dtype=np.uint8),
            np.ones(n, dtype=np.float32),
        )

    def __len__(self) -> int:
        return int(self.tokens.size)

    def depths(self) -> np.ndarray:
        d = np.zeros(len(self), dtype=np.int32)
        for i, p in enumerate(self.parents.tolist()):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def accept(self, target: np.ndarray) -> list[int]:
        """Node indices of the longest root path equal to a prefix of ``target``."""
        path = kernels.accepted_path(self.tokens, self.parents, np.ascontiguousarray(target, dtype=np.int32))
        return list(path.tolist())


class DraftedTrees(Sequence[DraftTree]):
    """The trees of one draft call, read where the call left them: each is made a
    :class:`DraftTree` (views of the batch's arrays) only when asked for, so a batch sent as it
    is never makes one."""

    __slots__ = ("batch",)

    def __init__(self, batch: TreeBatch) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return int(self.batch.offsets.size) - 1

    @overload
    def __getitem__(self, j: int) -> DraftTree: ...

    @overload
    def __getitem__(self, j: slice) -> list[DraftTree]: ...

    def __getitem__(self, j: int | slice) -> DraftTree | list[DraftTree]:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        b = self.batch
        n = b.offsets.size - 1
        if not -n <= j < n:
            raise IndexError(j)
        j %= n
        lo, hi = b.offsets[j : j + 2].tolist()
        return DraftTree(b.tokens[lo:hi], b.parents[lo:hi], b.sources[lo:hi], b.scores[lo:hi], b, j)


def whole_batch(trees: Sequence[DraftTree]) -> TreeBatch | None:
    """The batch ``trees`` are, when they are every tree of one batch in its order."""
    if isinstance(trees, DraftedTrees):
        return trees.batch
    batch = trees[0].batch if trees else None
    if batch is None or len(trees) != batch.offsets.size - 1:
        return None
    for j, tree in enumerate(trees):
        if tree.batch is not batch or tree.row != j:
            return None
    return batch


def build_tree(
    candidates: list[Candidates],
    *,
    budget: int,
    max_depth: int,
    min_score: float = 0.0,
    depth_reserve: int = 0,
) -> DraftTree:
    """Merge tiers into one tree of at most ``budget`` nodes and ``max_depth`` levels.

    >>> a = Candidates(Tier.CONTEXT, np.array([[5, 6, 7]], np.int32), weights=np.ones(1), confidence=0.9)
    >>> b = Candidates(Tier.PRIOR, np.array([[5, 9, -1]], np.int32), probs=np.array([[0.5, 0.4, 0.0]]))
    >>> t = build_tree([a, b], budget=3, max_depth=3)
    >>> t.tokens.tolist(), t.parents.tolist()  # 5 is shared (0.9 + 0.5); 6 (0.9) beats 9 (0.4)
    ([5, 6, 7], [-1, 0, 1])
    """
    return merge_candidates(
        candidates, budget=budget, max_depth=max_depth, min_score=min_score, depth_reserve=depth_reserve
    )[0]


def merge_candidates(
    candidates: list[Candidates],
    *,
    budget: int,
    max_depth: int,
    min_score: float = 0.0,
    depth_reserve: int = 0,
) -> tuple[DraftTree, dict[Tier, tuple[int, float]]]:
    """:func:`build_tree` plus, per tier, its most likely first token and that token's
    probability under the tier alone (what calibration compares with the outcome)."""
    return merge_many([MergeJob(candidates, budget, max_depth, min_score, depth_reserve)])[0]


class MergeJob(NamedTuple):
    """One tree to merge: its tiers' candidates and limits (see :func:`build_tree`)."""

    candidates: Sequence[Candidates]
    budget: int
    max_depth: int
    min_score: float = 0.0
    depth_reserve: int = 0


def merge_many(jobs: Sequence[MergeJob]) -> list[tuple[DraftTree, dict[Tier, tuple[int, float]]]]:
    """:func:`merge_candidates` for many trees in one compiled call (a batch's drafts)."""
    parts: list[Candidates] = []
    offsets = [0]
    for job in jobs:
        if job.budget < 0 or job.max_depth < 0:
            raise ValueError(f"budget and max_depth must be >= 0, got {job.budget}, {job.max_depth}")
        parts.extend(c for c in job.candidates if c.rows.size)
        offsets.append(len(parts))
    if not parts:
        return [(DraftTree.empty(), {}) for _ in jobs]
    limits = np.array([(j.max_depth, j.budget, j.depth_reserve) for j in jobs], dtype=np.int64)
    tokens, parents, sources, scores, bounds, first_tok, first_val = kernels.merge_batch(
        *flat_parts(parts),
        np.array(offsets, dtype=np.int64),
        limits[:, 0],
        limits[:, 1],
        np.array([float(j.min_score) for j in jobs], dtype=np.float64),
        limits[:, 2],
        _N_TIERS,
    )
    ends, first_tokens, first_values = bounds.tolist(), first_tok.tolist(), first_val.tolist()
    out = []
    for j in range(len(jobs)):
        a, b = ends[j], ends[j + 1]
        firsts = {}
        for c in parts[offsets[j] : offsets[j + 1]]:
            tok = first_tokens[j][c.tier]
            if tok >= 0 and c.confidence > 0:
                firsts[c.tier] = (tok, first_values[j][c.tier] / c.confidence)
        out.append((DraftTree(tokens[a:b], parents[a:b], sources[a:b], scores[a:b]), firsts))
    return out


def flat_parts(parts: Sequence[Candidates]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty parts laid end to end as the compiled merge reads them
    (:func:`~indexer.kernels.tree.stack_parts`): their rows' tokens, their values, per part
    ``(rows, width, per-cell values, tier)`` (one small array instead of four), and their
    confidences."""
    meta = np.array([(*c.rows.shape, c.probs is not None, c.tier) for c in parts], dtype=np.int64)
    return (
        np.concatenate([c.rows.ravel() for c in parts]).astype(np.int32, copy=False),
        np.concatenate([_values(c).ravel() for c in parts]).astype(np.float64, copy=False),
        meta,
        np.array([c.confidence for c in parts], dtype=np.float64),
    )


def _values(c: Candidates) -> np.ndarray:
    values = c.probs if c.probs is not None else c.weights
    assert values is not None  # Candidates guarantees one of the two
    return values

"""Cost-aware verification: how many draft tokens are worth verifying this step.

On a GPU, verifying 64 tokens costs about as much as decoding one; on a CPU it does not. The
cost curve of the actual device is measured once (forward passes of 1, 2, 4, ... query tokens
against a KV cache of a realistic length), and each step keeps the prefix of the tree (its nodes
most likely first, which is always a valid subtree) that maximises expected tokens per second:
``(1 + sum of kept worths) / cost(kept + 1)``, a node's worth being the probability that the
target accepts its whole root path. A weak tree shrinks to a token or two, or to nothing, so
speculation never costs more than it is expected to return.

The drafter's scores are not calibrated for a given target, so worths come from an
:class:`AcceptanceModel` learned online: for each node, the probability that the target accepts
it given that it accepted its parent, per (tier, depth, score) bucket, counted from what the
target actually produced. Greedy decoding reveals the outcome of every drafted node whose parent
was right, verified or not (the next tokens are known once produced), so the model learns from
whole trees and needs no exploration; it starts from a fraction of the drafter's own estimates
(conservative), and a node's worth is the product of these probabilities along its path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from decoder_client.forward_timing import SIZES, forward_seconds
from decoder_client.reference_decoder import VerifiedTopk
from indexer.tree_builder import DraftTree, Tier


@dataclass(frozen=True)
class CostCurve:
    """Seconds per forward pass by query-block size (interpolated between measured sizes)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes or any(s <= 0 for s in self.seconds):
            raise ValueError("a cost curve needs one positive time per size")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] != 1:
            raise ValueError("sizes must be increasing and start at 1")

    def cost(self, n: np.ndarray | int) -> np.ndarray:
        return np.asarray(np.interp(n, self.sizes, self.seconds))

    def verify_seconds(self, n: int) -> float:
        """A step's forward that verifies ``n`` draft tokens (``n + 1`` query tokens).

        >>> CostCurve((1, 2, 4), (1.0, 1.1, 4.0)).verify_seconds(2)
        2.55
        """
        return float(self.cost(n + 1))

    @classmethod
    def measure(cls, model: torch.nn.Module, *, context: int = 512, repeats: int = 3) -> CostCurve:
        """Time verification forwards (a chain's mask and positions, as the decoder sends them)
        of each size on ``model``'s device against a ``context``-token KV cache; the fastest of
        ``repeats`` rounds over all sizes (other work on the machine only ever adds time)."""
        best = forward_seconds(model, SIZES, context=context, repeats=repeats)[""]
        return cls(SIZES, tuple(best[n] for n in SIZES))


def best_subtree(tree: DraftTree, curve: CostCurve, worth: np.ndarray | None = None) -> DraftTree:
    """The prefix of ``tree`` (highest worth first) with the most expected tokens per second.

    ``worth`` (n,) is each node's probability of being accepted with its whole root path; by
    default the drafter's scores, capped by their parents'.

    >>> curve = CostCurve((1, 2, 4), (1.0, 1.1, 4.0))
    >>> t = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, 0, 1], np.int32),
    ...               np.zeros(3, np.uint8), np.array([0.9, 0.5, 0.1], np.float32))
    >>> best_subtree(t, curve).tokens.tolist()  # (1 + 0.9) / 1.1 beats 1 / 1.0 and (1 + 1.4) / 2.55
    [5]
    """
    if len(tree) == 0:
        return tree
    if worth is None:
        worth = capped_scores(tree)
    # Worth never grows along a path, so the best-first order lists parents before children
    # (ties keep wire order, where parents come first) and every prefix is a tree.
    order = np.argsort(-worth, kind="stable")
    gain = 1.0 + np.concatenate(([0.0], np.cumsum(worth[order])))
    rate = gain / curve.cost(np.arange(1, len(tree) + 2))  # k kept nodes: k + 1 query tokens
    return subtree(tree, np.sort(order[: int(np.argmax(rate))]))


def capped_scores(tree: DraftTree) -> np.ndarray:
    """The drafter's scores, each capped by its parent's (a node is only verified through it).

    >>> t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32), np.zeros(2, np.uint8),
    ...               np.array([0.2, 0.9], np.float32))
    >>> capped_scores(t).round(2).tolist()
    [0.2, 0.2]
    """
    worth = tree.scores.astype(np.float64)
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0 and worth[i] > worth[p]:
            worth[i] = worth[p]
    return worth


def subtree(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """The nodes ``keep`` (ascending, every kept node's parent kept) with parents renumbered."""
    remap = np.full(len(tree), -1, dtype=np.int32)
    remap[keep] = np.arange(keep.size, dtype=np.int32)
    parents = tree.parents[keep]
    return DraftTree(
        tree.tokens[keep],
        np.where(parents >= 0, remap[np.maximum(parents, 0)], -1).astype(np.int32),
        tree.sources[keep],
        tree.scores[keep],
    )


# -- calibration ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """Buckets of the acceptance model and its prior."""

    score_edges: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.999)  # inner edges
    depth_edges: tuple[int, ...] = (2, 3, 5, 9)  # depth buckets 1, 2, 3-4, 5-8, 9+
    prior_strength: float = 8.0  # pseudo-observations behind each bucket's prior
    prior_scale: float = 0.25  # cold start: a score s means acceptance s * prior_scale

    def __post_init__(self) -> None:
        e = self.score_edges
        if not e or list(e) != sorted(set(e)) or e[0] <= 0.0 or e[-1] >= 1.0:
            raise ValueError(f"score_edges must increase strictly inside (0, 1), got {e}")
        d = self.depth_edges
        if list(d) != sorted(set(d)) or (d and d[0] < 2):
            raise ValueError(f"depth_edges must increase strictly from >= 2, got {d}")
        if self.prior_strength <= 0.0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength}")
        if not 0.0 < self.prior_scale <= 1.0:
            raise ValueError(f"prior_scale must be in (0, 1], got {self.prior_scale}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tiers, depth buckets, score buckets)."""
        return len(Tier), len(self.depth_edges) + 1, len(self.score_edges) + 1

    def prior_means(self) -> np.ndarray:
        """Cold-start acceptance per score bucket: its middle score times ``prior_scale``."""
        edges = np.array([0.0, *self.score_edges, 1.0])
        return self.prior_scale * (edges[:-1] + edges[1:]) / 2


def node_cells(tree: DraftTree, depths: np.ndarray, config: CalibrationConfig) -> np.ndarray:
    """Flat bucket index per node: (tier, depth bucket, score bucket) in ``config.shape``.

    >>> t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32),
    ...               np.array([1, 1], np.uint8), np.array([0.95, 0.01], np.float32))
    >>> node_cells(t, t.depths(), CalibrationConfig()).tolist()  # tier 1: depth 1 top bucket, depth 2 bottom
    [58, 60]
    """
    _, nd, ns = config.shape
    d = np.searchsorted(np.asarray(config.depth_edges), depths, side="right")
    s = np.searchsorted(np.asarray(config.score_edges), tree.scores, side="right")
    return np.asarray((tree.sources.astype(np.int64) * nd + d) * ns + s)


def calibrated_table(hits: np.ndarray, trials: np.ndarray, config: CalibrationConfig) -> np.ndarray:
    """Acceptance probability per bucket (``config.shape``), given the parent was accepted.

    Each bucket's Beta posterior is centred on the same depth and score bucket pooled over
    tiers, itself centred on the cold-start prior; then probabilities are made non-decreasing
    in the score by capping each bucket at every higher one's (never optimistic).

    >>> cfg = CalibrationConfig(score_edges=(0.5,), depth_edges=(), prior_strength=2.0, prior_scale=0.5)
    >>> hits, trials = np.zeros(cfg.shape), np.zeros(cfg.shape)
    >>> hits[1, 0, 1], trials[1, 0, 1] = 6, 6  # tier 1 was always right on high scores
    >>> t = calibrated_table(hits, trials, cfg)
    >>> round(float(t[1, 0, 1]), 3), round(float(t[0, 0, 1]), 3), round(float(t[0, 0, 0]), 3)
    (0.961, 0.844, 0.125)
    """
    k = config.prior_strength
    pooled = (hits.sum(axis=0) + k * config.prior_means()) / (trials.sum(axis=0) + k)
    table = (hits + k * pooled) / (trials + k)
    return np.asarray(np.minimum.accumulate(table[..., ::-1], axis=-1)[..., ::-1])


def sibling_normalised(parents: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``q`` scaled down where siblings' probabilities sum past one (only one can be right).

    >>> sibling_normalised(np.array([-1, -1, 0], np.int32), np.array([0.8, 0.4, 0.5])).round(3).tolist()
    [0.667, 0.333, 0.5]
    """
    total = np.zeros(parents.size + 1)
    np.add.at(total, parents + 1, q)
    return np.asarray(q / np.maximum(1.0, total[parents + 1]))


def path_worth(parents: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Probability that each node's whole root path is accepted: the product of ``q`` along it.

    >>> path_worth(np.array([-1, 0, 1, -1], np.int32), np.array([0.5, 0.5, 1.0, 0.2])).tolist()
    [0.5, 0.25, 0.25, 0.2]
    """
    worth = np.asarray(q, dtype=np.float64).copy()
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            worth[i] *= worth[p]
    return worth


def observed(parents: np.ndarray, depths: np.ndarray, path: list[int], known: int, done: int) -> np.ndarray:
    """Nodes whose outcome ``known`` tokens after the tree's root decide, beyond depth ``done``:
    children of the root or of an accepted node (``path``) at depth ``done + 1 .. known``.

    >>> parents, depths = np.array([-1, -1, 0, 2], np.int32), np.array([1, 1, 2, 3])
    >>> observed(parents, depths, [0], known=2, done=0).tolist()  # node 3's parent (2) was rejected
    [True, True, True, False]
    >>> observed(parents, depths, [0, 2], known=3, done=2).tolist()  # only node 3 is new
    [False, False, False, True]
    """
    on_path = np.zeros(parents.size + 1, dtype=bool)
    on_path[0] = True
    on_path[np.asarray(path, dtype=np.int64) + 1] = True
    return np.asarray(on_path[parents + 1] & (depths > done) & (depths <= known))


class AcceptanceModel:
    """Acceptance counts per bucket, shared by every request of a decoder (it learns across them).

    >>> m = AcceptanceModel(CalibrationConfig())
    >>> cells = np.array([58, 58])
    >>> before = m.probabilities(cells)[0]
    >>> m.update(cells, np.array([True, True]), np.array([True, True]))
    >>> bool(m.probabilities(cells)[0] > before)
    True
    """

    def __init__(self, config: CalibrationConfig) -> None:
        self.config = config
        self.hits = np.zeros(config.shape)
        self.trials = np.zeros(config.shape)
        self._table: np.ndarray | None = None

    def probabilities(self, cells: np.ndarray) -> np.ndarray:
        if self._table is None:
            self._table = calibrated_table(self.hits, self.trials, self.config).ravel()
        return np.asarray(self._table[cells])

    def update(self, cells: np.ndarray, hit: np.ndarray, seen: np.ndarray) -> None:
        """Count the outcome ``hit`` of every node ``seen``."""
        if not seen.any():
            return
        np.add.at(self.trials.reshape(-1), cells[seen], 1.0)
        np.add.at(self.hits.reshape(-1), cells[seen & hit], 1.0)
        self._table = None


@dataclass
class _Pending:
    """A drafted tree whose outcomes are not all known yet."""

    tree: DraftTree
    cells: np.ndarray
    depths: np.ndarray
    start: int  # context length when it was drafted
    done: int = 0  # depths already counted


@dataclass
class CalibratedDrafter:
    """A reference-decoder drafter whose trees are cut by calibrated worth (one per request).

    Each call first counts the outcomes the new context reveals for earlier trees, then drafts,
    values every node with ``model`` and keeps the most profitable prefix under ``curve``, each
    kept node scored by its worth (its chance of being accepted with its root path).
    """

    drafter: Callable[[np.ndarray], DraftTree]
    curve: CostCurve
    model: AcceptanceModel
    _pending: list[_Pending] = field(default_factory=list)

    def __call__(self, context: np.ndarray) -> DraftTree:
        self._learn(context)
        tree = self.drafter(context)
        if len(tree) == 0:
            return tree
        depths = tree.depths()
        cells = node_cells(tree, depths, self.model.config)
        self._pending.append(_Pending(tree, cells, depths, int(context.size)))
        q = sibling_normalised(tree.parents, self.model.probabilities(cells))
        worth = path_worth(tree.parents, q)
        valued = DraftTree(tree.tokens, tree.parents, tree.sources, worth.astype(np.float32))
        return best_subtree(valued, self.curve, worth)

    def observe_topk(self, verified: VerifiedTopk) -> None:
        """Passed on to the wrapped drafter, if it takes the target's top-k."""
        observe = getattr(self.drafter, "observe_topk", None)
        if observe is not None:
            observe(verified)

    def _learn(self, context: np.ndarray) -> None:
        still = []
        for item in self._pending:
            known = context[item.start : item.start + int(item.depths.max())]
            path = item.tree.accept(known)
            seen = observed(item.tree.parents, item.depths, path, known.size, item.done)
            hit = np.zeros(len(item.tree), dtype=bool)
            hit[path] = True
            self.model.update(item.cells, hit, seen)
            # Undecided while the accepted path runs to the end of what is known and goes on.
            last = path[-1] if path else -1
            if len(path) == known.size and bool(np.any(item.tree.parents == last)):
                item.done = known.size
                still.append(item)
        self._pending = still


def cost_aware(
    drafter: Callable[[np.ndarray], DraftTree], curve: CostCurve, model: AcceptanceModel | None = None
) -> Callable[[np.ndarray], DraftTree]:
    """Wrap a reference-decoder drafter so every tree is cut to its most profitable prefix,
    valued by ``model`` (learning as it goes), else by the drafter's raw scores."""
    if model is not None:
        return CalibratedDrafter(drafter, curve, model)

    def draft(context: np.ndarray) -> DraftTree:
        return best_subtree(drafter(context), curve)

    return draft

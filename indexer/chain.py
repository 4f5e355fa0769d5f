"""Cutting a draft tree to the chain an engine verifies: the path of at most ``k`` tokens with
the largest expected accepted length.

Engines (vLLM, SGLang, llama.cpp) verify one chain of at most ``k`` tokens. Its expected
accepted length is the sum over its nodes of the probability that the target accepts every
node up to there: the product of each node's acceptance probability given its parent's. A
dynamic programme over the tree finds the path maximising that sum (not the path of the
highest-scoring child at each level), and a node whose cumulative probability falls below
``min_prob`` ends the chain (an engine pays for every token it verifies).

Tree scores are not those probabilities. A node's score sums every tier's estimate that its
prefix follows (tiers that agree add up: the trie merges their votes) and is capped at 1;
measured on Spec-Bench, nodes scoring 0.4-0.5 were accepted 4% of the time, nodes at the cap
35%. So :class:`ChainCalibrator` learns, online from the namespace's own outcomes, the
probability that a node is accepted given its parent was, per (score ratio to the parent,
score, tier, depth) cell, backed off to the ratio alone while a cell has seen little.
"""

from __future__ import annotations

import numpy as np

from indexer.tree_builder import DraftTree, Tier

_RATIO_BINS = 9  # score / parent score in eighths, 1.0 in a bin of its own
_SCORE_EDGES = np.array([0.05, 0.1, 0.2, 0.4, 0.7, 0.99])  # the node's own score
_DEPTHS = 4  # depths 1, 2, 3 and 4 or more
_COARSE_PRIOR = 2.0  # pseudo-trials at the ratio's own claim, per ratio bin
_FINE_PRIOR = 4.0  # pseudo-trials at the ratio bin's estimate, per fine cell


def _ratio_bins(tree: DraftTree) -> np.ndarray:
    scores = tree.scores.astype(np.float64)
    parents = tree.parents.astype(np.int64)
    parent = np.where(parents >= 0, scores[np.maximum(parents, 0)], 1.0)
    ratio = np.clip(scores / np.maximum(parent, 1e-9), 0.0, 1.0)
    return np.minimum((ratio * 8).astype(np.int64), _RATIO_BINS - 1)


class ChainCalibrator:
    """Probability that a draft node is accepted once its parent was, learned from outcomes.

    >>> cal = ChainCalibrator()
    >>> t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32),
    ...               np.zeros(2, np.uint8), np.array([1.0, 1.0], np.float32))
    >>> for _ in range(50):
    ...     cal.update(t, np.array([5, 9], np.int32))  # 5 always accepted, 6 never
    >>> [round(p, 2) for p in cal.conditional(t).tolist()]
    [0.96, 0.04]
    """

    def __init__(self) -> None:
        shape = (_RATIO_BINS, _SCORE_EDGES.size + 1, len(Tier), _DEPTHS)
        self._hits = np.zeros(shape)
        self._trials = np.zeros(shape)
        self._coarse_hits = np.zeros(_RATIO_BINS)
        self._coarse_trials = np.zeros(_RATIO_BINS)
        # Before any outcome a ratio bin claims its midpoint (the scores' own estimate).
        self._claim = (np.arange(_RATIO_BINS) + 0.5) / 8
        self._claim[-1] = 1.0

    def _cells(self, tree: DraftTree) -> tuple[np.ndarray, ...]:
        depths = np.minimum(tree.depths(), _DEPTHS) - 1
        score = np.searchsorted(_SCORE_EDGES, tree.scores.astype(np.float64), side="right")
        return _ratio_bins(tree), score, tree.sources.astype(np.int64), depths.astype(np.int64)

    def conditional(self, tree: DraftTree) -> np.ndarray:
        """Per node, the probability it is accepted given its parent was (float64)."""
        if not len(tree):
            return np.zeros(0)
        cells = self._cells(tree)
        ratio = cells[0]
        coarse = (self._coarse_hits[ratio] + _COARSE_PRIOR * self._claim[ratio]) / (
            self._coarse_trials[ratio] + _COARSE_PRIOR
        )
        return (self._hits[cells] + _FINE_PRIOR * coarse) / (self._trials[cells] + _FINE_PRIOR)

    def update(self, tree: DraftTree, produced: np.ndarray) -> None:
        """Learn from the tokens the target produced after ``tree`` (accepted ones plus the bonus
        token): every node whose parent matched them and whose depth they reach is a trial,
        a hit where its token is the one produced there."""
        n = len(tree)
        if not n or not produced.size:
            return
        parents = tree.parents.tolist()
        tokens = tree.tokens.tolist()
        truth = produced.tolist()
        matched = [False] * n  # the node's path equals the produced tokens
        trial = np.zeros(n, dtype=bool)
        depth = [0] * n
        for i in range(n):  # wire order: a parent precedes its children
            p = parents[i]
            depth[i] = 1 if p < 0 else depth[p] + 1
            if (p < 0 or matched[p]) and depth[i] <= len(truth):
                trial[i] = True
                matched[i] = tokens[i] == truth[depth[i] - 1]
        if not trial.any():
            return
        hit = np.array(matched, dtype=np.float64)[trial]
        cells = tuple(c[trial] for c in self._cells(tree))
        np.add.at(self._trials, cells, 1.0)
        np.add.at(self._hits, cells, hit)
        np.add.at(self._coarse_trials, cells[0], 1.0)
        np.add.at(self._coarse_hits, cells[0], hit)


def best_path(
    parents: np.ndarray,
    conditional: np.ndarray,
    k: int,
    min_prob: float = 0.0,
    preference: np.ndarray | None = None,
) -> np.ndarray:
    """Node indices of the root path of at most ``k`` nodes with the largest sum of cumulative
    probabilities (the expected accepted length), nodes whose cumulative probability is below
    ``min_prob`` left out. ``parents`` in wire order (a parent before its children); ties go to
    the earlier node. ``preference``, where given, replaces ``conditional`` in the sum (not in
    the ``min_prob`` cut): per-node weights that rank paths more finely.

    >>> parents = np.array([-1, -1, 0, 1, 3], np.int32)
    >>> best_path(parents, np.array([0.6, 0.5, 0.3, 0.9, 0.9]), 3).tolist()  # 0.5+.45+.405 > 0.6+.18
    [1, 3, 4]
    >>> best_path(parents, np.array([0.6, 0.5, 0.3, 0.9, 0.9]), 1).tolist()  # one token: 0.6 > 0.5
    [0]
    """
    n = parents.size
    if n == 0 or k <= 0:
        return np.zeros(0, dtype=np.int64)
    par = parents.astype(np.int64)
    cumulative = conditional.astype(np.float64).copy()
    for i in range(n):  # wire order: the parent's cumulative probability is final
        if par[i] >= 0:
            cumulative[i] *= cumulative[par[i]]
    usable = cumulative >= min_prob if min_prob > 0 else cumulative > 0
    if preference is not None:
        cumulative = preference.astype(np.float64).copy()
        for i in range(n):
            if par[i] >= 0:
                cumulative[i] *= cumulative[par[i]]
    # value[j][i]: the best sum of a path of at most j nodes starting at node i.
    value = np.zeros((k + 1, n))
    linked = (par >= 0) & usable  # nodes that extend a usable parent's paths
    for j in range(1, k + 1):
        below = np.zeros(n)
        np.maximum.at(below, par[linked], value[j - 1][linked])
        value[j] = np.where(usable, cumulative + below, 0.0)
    path: list[int] = []
    parent = -1
    for j in range(k, 0, -1):
        kids = np.flatnonzero((par == parent) & usable)
        if not kids.size:
            break
        best = int(kids[np.argmax(value[j][kids])])  # argmax: the first of equals
        path.append(best)
        parent = best
    return np.array(path, dtype=np.int64)


def cut_to_chain(tree: DraftTree, k: int, conditional: np.ndarray, min_prob: float = 0.0) -> DraftTree:
    """``tree``'s best chain of at most ``k`` tokens (see :func:`best_path`) as a tree whose
    parents are -1, 0, 1, ...; its scores are the nodes' cumulative probabilities.

    >>> t = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, -1, 1], np.int32),
    ...               np.zeros(3, np.uint8), np.ones(3, np.float32))
    >>> c = cut_to_chain(t, 4, np.array([0.6, 0.5, 0.8]))
    >>> c.tokens.tolist(), c.parents.tolist()  # 0.5 + 0.4 beats 0.6 alone
    ([6, 7], [-1, 0])
    """
    # Nodes of one calibration cell share its rate; their scores still rank them (measured on
    # Spec-Bench, K=8: the rate times the score picks paths 0.6% longer than the rate alone).
    preference = conditional * tree.scores.astype(np.float64)
    path = best_path(tree.parents, conditional, k, min_prob, preference)
    cumulative = np.cumprod(conditional[path]) if path.size else np.zeros(0)
    return DraftTree(
        tree.tokens[path].astype(np.int32),
        np.arange(-1, path.size - 1, dtype=np.int32),
        tree.sources[path].astype(np.uint8),
        cumulative.astype(np.float32),
    )

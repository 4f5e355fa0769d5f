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
score, tier, depth, track record) cell, backed off to (ratio, track record), and that to the
ratio alone, while a cell has seen little. The track record is how far the target followed the
session's previous tree (0, 1, 2-3, 4-7, 8-15, 16+ tokens): a request that is retracing text
the memory holds (an agent's repeated task, a quoted document) keeps being followed, one that
left it keeps missing, whatever the scores say, and a chain's stopping point should know which
it is. The longest chains engines verify (24 tokens) are followed whole only where a request
retraces: a last chain followed 16 deep says more than one followed 4 deep, and lumped together
(4+) the deep tokens of a retrace were claimed as unsure as those of a lucky copy, and cut (on the
SmolLM2 and agent traces, chains of 24 at a proposed token's cost of 0.11-0.13 of a step: 0.8-1.8%
more tokens per unit of verification time; chains of 8 level).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from indexer.kernels.chain import (
    DEPTH_EDGES,
    DEPTHS,
    RANKS,
    RATIO_BINS,
    TRACK_EDGES,
    TRACKS,
    chain_backoff,
    chain_batch,
    chain_cells,
    chain_conditional,
    chain_outcome,
    chain_outcome_rows,
    chain_path,
    chain_reach_outcome,
)
from indexer.tree_builder import DraftTree, Tier, TreeBatch

_SCORE_EDGES = np.array([0.05, 0.1, 0.2, 0.4, 0.7, 0.99])  # the node's own score
_COARSE_PRIOR = 2.0  # pseudo-trials at the ratio's own claim, per ratio bin
_FINE_PRIOR = 4.0  # pseudo-trials at the ratio bin's estimate, per fine cell
# A chain's claimed reach (the product of its nodes' conditionals), binned for its second
# calibration, and the pseudo-trials at the claim itself per (depth, claim) cell.
_REACH_EDGES = np.array([0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
_REACH_PRIOR = 8.0
_TRACK_EDGES = np.array(TRACK_EDGES)


class ChainCalibrator:
    """Probability that a draft node is accepted once its parent was, learned from outcomes.

    >>> cal = ChainCalibrator()
    >>> t = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32),
    ...               np.zeros(2, np.uint8), np.array([1.0, 1.0], np.float32))
    >>> for _ in range(50):
    ...     track = cal.update(t, np.array([5, 9], np.int32))  # 5 always accepted, 6 never
    >>> track, [round(p, 2) for p in cal.conditional(t).tolist()]  # followed 1 deep; track 0's rates
    (1, [0.96, 0.04])
    >>> [round(p, 2) for p in cal.conditional(t, track=3).tolist()]  # none there yet: the ratio bin's rate
    [0.51, 0.51]
    """

    def __init__(self) -> None:
        shape = (RATIO_BINS, _SCORE_EDGES.size + 1, len(Tier), DEPTHS, TRACKS, RANKS)
        self._hits = np.zeros(shape)
        self._trials = np.zeros(shape)
        self._coarse_hits = np.zeros((RATIO_BINS, TRACKS))
        self._coarse_trials = np.zeros((RATIO_BINS, TRACKS))
        # The chains cut: per (track record, depth bin, claimed-reach bin), how many nodes were
        # reached and the sum of their claims.
        self._reach_hits = np.zeros((TRACKS, DEPTHS, _REACH_EDGES.size + 1))
        self._reach_claims = np.zeros((TRACKS, DEPTHS, _REACH_EDGES.size + 1))
        # Before any outcome a ratio bin claims its midpoint (the scores' own estimate).
        self._claim = (np.arange(RATIO_BINS) + 0.5) / 8
        self._claim[-1] = 1.0
        self._coarse: np.ndarray | None = None  # the (ratio, track record) rates, until an update

    @staticmethod
    def _cells(tree: DraftTree, track: int) -> np.ndarray:
        if not 0 <= track < TRACKS:
            raise ValueError(f"track must be in [0, {TRACKS}), got {track}")
        return chain_cells(tree.parents, tree.scores, tree.sources, _SCORE_EDGES, track)

    def conditional(self, tree: DraftTree, track: int = 0) -> np.ndarray:
        """Per node, the probability it is accepted given its parent was (float64), for a
        session whose track record is ``track`` (:func:`track_of`)."""
        if not len(tree):
            return np.zeros(0)
        return chain_conditional(self._cells(tree, track), self._hits, self._trials, self._backoff(), _FINE_PRIOR)

    def _backoff(self) -> np.ndarray:
        """The rates a fine cell backs off to. Three levels: a fine cell backs off to its (ratio,
        track record), that to its ratio bin over every track record, that to the scores' own
        claim. A fresh namespace's outcomes so teach every track record at once, and each its
        own as they come. Kept until the next outcome is learnt."""
        if self._coarse is None:
            self._coarse = chain_backoff(self._coarse_hits, self._coarse_trials, self._claim, _COARSE_PRIOR)
        return self._coarse

    def chain(self, tree: DraftTree, k: int, min_prob: float = 0.0, track: int = 0) -> tuple[DraftTree, np.ndarray]:
        """:func:`chain_of` with this calibrator's conditionals and reach, in one compiled pass
        (:meth:`chains` for one tree): the chain (its scores the reach) and its nodes' raw claims."""
        one = TreeBatch(tree.tokens, tree.parents, tree.sources, tree.scores, np.array([0, len(tree)], dtype=np.int64))
        batch, claims = self.chains(one, np.array([k]), np.array([min_prob]), np.array([track]))
        return DraftTree(batch.tokens, batch.parents, batch.sources, batch.scores), claims

    def chains(
        self, batch: TreeBatch, ks: np.ndarray, min_probs: np.ndarray, tracks: np.ndarray
    ) -> tuple[TreeBatch, np.ndarray]:
        """:meth:`chain` for every tree of ``batch`` in one compiled call (tree ``j`` cut to at
        most ``ks[j]`` tokens at ``min_probs[j]``, for track record ``tracks[j]``): the chains
        as a batch, and their raw claims laid out as the chains are."""
        tracks = np.ascontiguousarray(tracks, dtype=np.int64)
        if tracks.size and not (tracks.min() >= 0 and tracks.max() < TRACKS):
            raise ValueError(f"tracks must be in [0, {TRACKS}), got {tracks.tolist()}")
        *arrays, claims = chain_batch(
            batch.tokens, batch.parents, batch.sources, batch.scores, batch.offsets,
            np.ascontiguousarray(ks, dtype=np.int64), np.ascontiguousarray(min_probs, dtype=np.float64), tracks,
            _SCORE_EDGES, self._hits, self._trials, self._backoff(), _FINE_PRIOR, self._reach_hits,
            self._reach_claims, _REACH_EDGES, _REACH_PRIOR,
        )  # fmt: skip
        return TreeBatch(*arrays), claims

    def cell_args(self) -> tuple:
        """The node cells' calibration as the draft step takes it (the last eight arguments of
        :func:`~indexer.kernels.draft.draft_batch`, which ranks a tree's nodes by it): the
        counts themselves (updated in place by each outcome, never replaced), so a draft reads
        every count as it stands, and the back-off is worked out there."""
        return (
            _SCORE_EDGES, self._hits, self._trials, self._coarse_hits, self._coarse_trials, self._claim,
            _COARSE_PRIOR, _FINE_PRIOR,
        )  # fmt: skip

    def reach_args(self) -> tuple:
        """The chains' reach calibration as :func:`~indexer.kernels.draft_chain.draft_chain_batch`
        takes it, after the jobs' ``ks``, ``min_probs`` and tracks."""
        return self._reach_hits, self._reach_claims, _REACH_EDGES, _REACH_PRIOR

    def reach(self, claims: np.ndarray, track: int = 0) -> np.ndarray:
        """A chain's nodes' claimed reach (by depth from 1: the products of their conditionals)
        as the chains cut so far bore them out for sessions of track record ``track``: each
        claim scaled by its (track record, depth, claim) cell's reached-to-claimed ratio,
        shrunk toward 1 by :data:`_REACH_PRIOR` pseudo-trials, and never rising along the chain.
        Conditionals calibrated one by one still over-claim deep nodes: their product assumes a
        path's steps independent, and a chain that drifts from the text it copies keeps
        drifting."""
        if not claims.size:
            return np.zeros(0)
        depth, bins = self._reach_cells(claims)
        hits, claimed = self._reach_hits[track, depth, bins], self._reach_claims[track, depth, bins]
        scaled = np.minimum(1.0, claims * (hits + _REACH_PRIOR) / (claimed + _REACH_PRIOR))
        return np.minimum.accumulate(scaled)

    def update_reach(self, tokens: np.ndarray, claims: np.ndarray, produced: np.ndarray, track: int = 0) -> None:
        """Learn from a cut chain (``tokens``, their raw ``claims``, cut for a session of track
        record ``track``) and the tokens the target produced after it (accepted plus the bonus):
        a node is reached while the chain matches them; past the first mismatch every node is
        known unreached, and where every produced token matched (the chain went on past what was
        verified) the rest are not counted."""
        if not 0 <= track < TRACKS:
            raise ValueError(f"track must be in [0, {TRACKS}), got {track}")
        chain_reach_outcome(
            np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(claims, dtype=np.float64),
            np.ascontiguousarray(produced, dtype=np.int32), self._reach_hits[track], self._reach_claims[track],
            _REACH_EDGES,
        )  # fmt: skip

    @staticmethod
    def _reach_cells(claims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        depth = np.searchsorted(DEPTH_EDGES, np.arange(1, claims.size + 1), side="right") - 1
        return depth, np.searchsorted(_REACH_EDGES, claims, side="right")

    @property
    def trials(self) -> int:
        """Outcomes learnt from so far: nodes whose parent the target accepted."""
        return int(self._coarse_trials.sum())

    def update_rows(
        self, i32: Any, i64: Any, rows: np.ndarray, produced: np.ndarray, ends: np.ndarray, tracks: np.ndarray
    ) -> list[int]:
        """:meth:`update` for the tree each session in store row ``rows[j]`` holds, drafted for
        its track record ``tracks[j]`` (-1: not learnt from), and the tokens produced after it
        (``produced`` between ``ends[j]`` and ``ends[j + 1]``), in one compiled pass. Returns
        each session's track record from now on (-1 where not learnt from)."""
        if not rows.size:
            return []
        if not (tracks.min() >= -1 and tracks.max() < TRACKS):
            raise ValueError(f"tracks must be -1 or in [0, {TRACKS}), got {tracks.tolist()}")
        self._coarse = None
        followed = chain_outcome_rows(
            i32, i64, rows, produced, ends, tracks, _SCORE_EDGES, self._hits, self._trials, self._coarse_hits,
            self._coarse_trials,
        )  # fmt: skip
        return np.where(tracks < 0, -1, tracks_of(followed)).tolist()

    def update(self, tree: DraftTree, produced: np.ndarray, track: int = 0) -> int:
        """Learn from the tokens the target produced after ``tree`` (accepted ones plus the bonus
        token), drafted for a session whose track record was ``track``: every node whose parent
        matched them and whose depth they reach is a trial, a hit where its token is the one
        produced there. Returns the session's track record from now on (:func:`track_of`)."""
        if not len(tree) or not produced.size:
            return 0
        self._coarse = None
        return track_of(
            chain_outcome(
                tree.parents,
                tree.tokens,
                np.ascontiguousarray(produced, dtype=np.int32),
                self._cells(tree, track),
                self._hits,
                self._trials,
                self._coarse_hits,
                self._coarse_trials,
            )
        )


def tracks_of(followed: np.ndarray) -> np.ndarray:
    """The track record of sessions whose last trees the target followed ``followed`` tokens
    deep: the bin of :data:`TRACK_EDGES` each falls in.

    >>> tracks_of(np.array([0, 1, 2, 3, 4, 7, 8, 15, 16, 24])).tolist()
    [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    """
    return np.maximum(np.searchsorted(_TRACK_EDGES, followed, side="right") - 1, 0)


def track_of(followed: int) -> int:
    """:func:`tracks_of` of one session.

    >>> track_of(5)
    3
    """
    return int(tracks_of(np.array([followed]))[0])


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
    conditional = np.ascontiguousarray(conditional, dtype=np.float64)
    weights = conditional if preference is None else np.ascontiguousarray(preference, dtype=np.float64)
    return chain_path(np.ascontiguousarray(parents, dtype=np.int32), conditional, weights, k, float(min_prob))


def cut_to_chain(tree: DraftTree, k: int, conditional: np.ndarray, min_prob: float = 0.0) -> DraftTree:
    """``tree``'s best chain of at most ``k`` tokens (see :func:`best_path`) as a tree whose
    parents are -1, 0, 1, ...; its scores are the nodes' cumulative probabilities.

    >>> t = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, -1, 1], np.int32),
    ...               np.zeros(3, np.uint8), np.ones(3, np.float32))
    >>> c = cut_to_chain(t, 4, np.array([0.6, 0.5, 0.8]))
    >>> c.tokens.tolist(), c.parents.tolist()  # 0.5 + 0.4 beats 0.6 alone
    ([6, 7], [-1, 0])
    """
    return chain_of(tree, k, conditional, min_prob)[0]


def chain_of(
    tree: DraftTree,
    k: int,
    conditional: np.ndarray,
    min_prob: float = 0.0,
    calibrator: ChainCalibrator | None = None,
    track: int = 0,
) -> tuple[DraftTree, np.ndarray]:
    """:func:`cut_to_chain`'s chain and its nodes' raw claims (the cumulative products of
    ``conditional``). With ``calibrator`` the chain's scores are its reach as chains cut so
    far for sessions of track record ``track`` bore such claims out
    (:meth:`ChainCalibrator.reach`), and it ends where those fall below ``min_prob``."""
    # Nodes of one calibration cell share its rate; their scores still rank them (measured on
    # Spec-Bench, K=8: the rate times the score picks paths 0.6% longer than the rate alone).
    preference = conditional * tree.scores.astype(np.float64)
    path = best_path(tree.parents, conditional, k, min_prob, preference)
    claims = np.cumprod(conditional[path]) if path.size else np.zeros(0)
    cumulative = claims
    if calibrator is not None:
        cumulative = calibrator.reach(claims, track)
        keep = int(np.count_nonzero(cumulative >= min_prob)) if min_prob > 0 else int(np.count_nonzero(cumulative > 0))
        path, claims, cumulative = path[:keep], claims[:keep], cumulative[:keep]
    return _chain(tree, path, cumulative), claims


def _chain(tree: DraftTree, path: np.ndarray, scores: np.ndarray) -> DraftTree:
    """The nodes ``path`` of ``tree`` as a chain, scored ``scores``."""
    return DraftTree(
        tree.tokens[path].astype(np.int32),
        np.arange(-1, path.size - 1, dtype=np.int32),
        tree.sources[path].astype(np.uint8),
        scores.astype(np.float32),
    )

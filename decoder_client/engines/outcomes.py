"""How the chains a proposer sent fared in the engine: each proposed token's chance of being
reached (its chain score) against whether the engine accepted it.

The engine shows the outcome at its next call: a row that was proposed ``d`` tokens comes back
having produced ``accepted + 1`` (the accepted drafts and the engine's own next token), so the
proposer knows, per proposed token, whether it was reached. Tokens are grouped by score into
bins; per bin the tokens proposed, the sum of their scores (what the scores expected to be
accepted) and the tokens accepted. Scores that are right give accepted ~ expected in every
bin; a bin accepted well below its expectation is where chains run longer than they pay for.

The same counts correct the scores (:meth:`ChainOutcomes.chances`): the service calibrates them
on its namespace's outcomes, which a young namespace has few of, and a proposer's requests may
fare otherwise than the namespace's (an engine retracing an agent's task). Each score is scaled
by its bin's accepted-to-expected ratio, so where a chain is cut follows what this engine
accepted.

>>> out = ChainOutcomes()
>>> out.record(np.array([0.9, 0.5, 0.2]), accepted=2)  # the first two reached, the third not
>>> out.record(np.array([0.9, 0.5]), accepted=0)
>>> s = out.summary()
>>> s["proposed_tokens"], s["expected_accepted"], s["accepted_tokens"]
(5, 3.0, 2)
>>> s["by_score"]["0.80-1.00"]
{'proposed': 2, 'expected': 1.8, 'accepted': 1}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

EDGES = np.array([0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0])  # score bins (the last closed)
PRIOR = 8.0  # pseudo-tokens per bin expected (and accepted) at the scores' own claim


class ChainOutcomes:
    """Proposed tokens by score: how many, expected and accepted; see the module docstring."""

    def __init__(self) -> None:
        n = EDGES.size - 1
        self.proposed = np.zeros(n, dtype=np.int64)
        self.expected = np.zeros(n, dtype=np.float64)
        self.accepted = np.zeros(n, dtype=np.int64)

    @staticmethod
    def _bins(scores: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(EDGES, scores, side="right") - 1, 0, EDGES.size - 2)

    def factors(self) -> np.ndarray:
        """Per bin, accepted over expected, shrunk toward 1 by :data:`PRIOR` pseudo-tokens. A bin
        nothing was proposed in takes the nearest such bin above it (else below): tokens below
        the cut are never proposed, so their bin learns only once its neighbour's rate lets them
        through."""
        ratio = (self.accepted + PRIOR) / (self.expected + PRIOR)
        seen = np.flatnonzero(self.proposed)
        if not seen.size:
            return np.ones_like(ratio)
        nearest = np.clip(np.searchsorted(seen, np.arange(ratio.size)), 0, seen.size - 1)
        return ratio[seen[nearest]]

    def chances(self, scores: np.ndarray) -> np.ndarray:
        """A chain's ``scores`` (chances of being reached, root first) as this engine's outcomes
        bore such scores out (:meth:`factors`), at most 1 and never rising along the chain.

        >>> out = ChainOutcomes()
        >>> for _ in range(10):  # chains whose 0.5 tokens were always accepted, 0.25 ones half the time
        ...     out.record(np.array([0.5, 0.25]), accepted=1)
        ...     out.record(np.array([0.5, 0.25]), accepted=2)
        >>> out.chances(np.array([0.5, 0.25, 0.12])).round(3).tolist()  # 0.12: its neighbour's rate
        [0.778, 0.346, 0.166]
        """
        if not scores.size:
            return np.zeros(0)
        scaled = np.minimum(1.0, scores * self.factors()[self._bins(scores)])
        return np.minimum.accumulate(scaled)

    def record(self, scores: np.ndarray, accepted: int) -> None:
        """A chain whose tokens had these ``scores`` (chances of being reached, root first) and
        whose first ``accepted`` tokens the engine kept."""
        self.record_many([scores], [accepted])

    def record_many(self, chains: Sequence[np.ndarray], accepted: Sequence[int]) -> None:
        """:meth:`record` for a step's chains at once: ``chains[j]``'s first ``accepted[j]``
        tokens kept.

        >>> out = ChainOutcomes()
        >>> out.record_many([np.array([0.9, 0.5]), np.array([]), np.array([0.95])], [1, 0, 1])
        >>> out.summary()["by_score"]["0.80-1.00"], out.summary()["accepted_tokens"]
        ({'proposed': 2, 'expected': 1.85, 'accepted': 2}, 2)
        """
        if len(chains) != len(accepted):
            raise ValueError(f"{len(chains)} chains, {len(accepted)} accepted counts")
        sizes = np.fromiter((c.size for c in chains), dtype=np.int64, count=len(chains))
        if not sizes.sum():
            return
        scores = np.concatenate(chains).astype(np.float64, copy=False)
        bins = self._bins(scores)
        # Each token's place in its chain: kept where it is among the chain's first accepted.
        place = np.arange(scores.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        kept = place < np.repeat(np.asarray(accepted, dtype=np.int64), sizes)
        n = self.proposed.size
        self.proposed += np.bincount(bins, minlength=n)
        self.expected += np.bincount(bins, weights=scores, minlength=n)
        self.accepted += np.bincount(bins[kept], minlength=n)

    def summary(self) -> dict[str, Any]:
        return {
            "proposed_tokens": int(self.proposed.sum()),
            "expected_accepted": round(float(self.expected.sum()), 3),
            "accepted_tokens": int(self.accepted.sum()),
            "by_score": {
                f"{EDGES[i]:.2f}-{EDGES[i + 1]:.2f}": {
                    "proposed": int(self.proposed[i]),
                    "expected": round(float(self.expected[i]), 3),
                    "accepted": int(self.accepted[i]),
                }
                for i in range(EDGES.size - 1)
                if self.proposed[i]
            },
        }

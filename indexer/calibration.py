"""Online calibration of tier confidence: how often each tier's first guess was right."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from indexer import kernels
from indexer.tree_builder import Tier


class Guess(NamedTuple):
    """A tier's most likely first token at the last draft, kept for calibration."""

    tier: Tier
    n: int
    token: int
    predicted: float


class Guesses(NamedTuple):
    """Every tier's first guess in one batch of drafts, by sequence and tier value: the token
    (-1: the tier had none), its probability and the match length it was found at.

    >>> g = Guesses(np.array([[7, -1]]), np.array([[0.5, 0.0]]), np.array([[2, 0]]))
    >>> g.of(0)  # the second tier had no guess
    [Guess(tier=<Tier.DYNAMIC: 0>, n=2, token=7, predicted=0.5)]
    """

    tokens: np.ndarray  # int64 (sequences, tiers)
    predicted: np.ndarray  # float64 (sequences, tiers)
    lengths: np.ndarray  # int64 (sequences, tiers)

    def of(self, j: int) -> list[Guess]:
        """Sequence ``j``'s guesses, one per tier that had one."""
        return [
            Guess(Tier(t), n, tok, p)
            for t, (tok, p, n) in enumerate(
                zip(self.tokens[j].tolist(), self.predicted[j].tolist(), self.lengths[j].tolist(), strict=True)
            )
            if tok >= 0
        ]


class Calibrator:
    """Per (tier, match length) ratio of first guesses accepted to first guesses predicted.

    >>> cal = Calibrator(buckets=4)
    >>> cal.update(Tier.PRIOR, 2, predicted=0.5, hit=False)
    >>> round(cal.factor(Tier.PRIOR, 2), 3)  # (0 + 2) / (0.5 + 2)
    0.8
    """

    def __init__(self, buckets: int) -> None:
        self._buckets = buckets
        self._pred = np.zeros((len(Tier), buckets + 1))
        self._hits = np.zeros((len(Tier), buckets + 1))

    def factor(self, tier: Tier, n: int) -> float:
        b = min(n, self._buckets)
        return float((self._hits[tier, b] + 2.0) / (self._pred[tier, b] + 2.0))

    def update(self, tier: Tier, n: int, *, predicted: float, hit: bool) -> None:
        b = min(n, self._buckets)
        self._pred[tier, b] += predicted
        self._hits[tier, b] += hit

    def update_rows(self, guesses: Guesses, rows: np.ndarray, actual: np.ndarray) -> None:
        """:meth:`update` for every tier's first guess of sequences ``rows`` of one batch of
        drafts, ``actual[i]`` being the token the target produced after row ``rows[i]``; row by
        row, tier by tier, as one :meth:`update` after another would."""
        kernels.calibrate(
            self._hits, self._pred, guesses.tokens, guesses.predicted, guesses.lengths, rows, actual, self._buckets
        )

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(accepted, predicted)`` per tier and bucket, the arrays themselves (compiled steps
        read them and count into them in place)."""
        return self._hits, self._pred

    def table(self) -> dict[str, list[float]]:
        """Acceptance rate of first guesses per tier and match-length bucket (for metrics)."""
        return {
            t.name: [
                round((h + 1) / (p + 1), 3) for h, p in zip(self._hits[t].tolist(), self._pred[t].tolist(), strict=True)
            ]
            for t in Tier
        }

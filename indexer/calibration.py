"""Online calibration of tier confidence: how often each tier's first guess was right."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from indexer.tree_builder import Tier

if TYPE_CHECKING:
    from indexer.session import Guess


class Calibrator:
    """Per (tier, match length) ratio of first guesses accepted to first guesses predicted.

    >>> cal = Calibrator(buckets=4)
    >>> cal.update(Tier.PRIOR, 2, predicted=0.5, hit=False)
    >>> round(cal.factor(Tier.PRIOR, 2), 3)  # (0 + 2) / (0.5 + 2)
    0.8
    """

    def __init__(self, buckets: int) -> None:
        self._buckets = buckets
        # Plain lists: this sits on the hot path, where numpy scalar arithmetic costs microseconds.
        self._pred = [[0.0] * (buckets + 1) for _ in Tier]
        self._hits = [[0.0] * (buckets + 1) for _ in Tier]

    def factor(self, tier: Tier, n: int) -> float:
        b = min(n, self._buckets)
        return (self._hits[tier][b] + 2.0) / (self._pred[tier][b] + 2.0)

    def update(self, tier: Tier, n: int, *, predicted: float, hit: bool) -> None:
        b = min(n, self._buckets)
        self._pred[tier][b] += predicted
        self._hits[tier][b] += hit

    def update_many(self, guesses: Iterable[Guess], actual: int) -> None:
        """:meth:`update` for each tier's first guess of one step, ``actual`` being the token
        the target produced."""
        for g in guesses:
            self.update(g.tier, g.n, predicted=g.predicted, hit=g.token == actual)

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(accepted, predicted)`` per tier and bucket, as arrays for compiled code."""
        return np.array(self._hits, dtype=np.float64), np.array(self._pred, dtype=np.float64)

    def table(self) -> dict[str, list[float]]:
        """Acceptance rate of first guesses per tier and match-length bucket (for metrics)."""
        return {
            t.name: [round((h + 1) / (p + 1), 3) for h, p in zip(self._hits[t], self._pred[t], strict=True)]
            for t in Tier
        }

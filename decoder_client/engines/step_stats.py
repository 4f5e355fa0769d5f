"""What a proposer inside an engine costs each step, beside the engine's step time.

The proposer's own time (its bookkeeping, the client's work and the round trip to the service)
is measured around each call the engine makes to it; the engine's step time is the interval
between the starts of two consecutive calls (it includes the proposer's time), as
:class:`~decoder_client.engines.step_clock.StepClock` reads it (pauses are not steps).

>>> stats = StepStats()
>>> stats.record(interval=None, seconds=0.001, rows=2)
>>> stats.record(interval=0.02, seconds=0.003, rows=2)
>>> s = stats.summary()
>>> s["steps"], s["rows"], round(s["proposer_ms_mean"], 3), round(s["step_ms_mean"], 3)
(2, 4, 2.0, 20.0)
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

WINDOW = 4096  # the latest steps percentiles are taken over


class StepStats:
    """Per-step timings of a proposer; see the module docstring."""

    def __init__(self) -> None:
        self.steps = 0
        self.rows = 0
        self.proposer_s = 0.0
        self.step_s = 0.0  # summed intervals between busy steps
        self.intervals = 0
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._recent_steps: deque[float] = deque(maxlen=WINDOW)

    def record(self, *, interval: float | None, seconds: float, rows: int) -> None:
        """One call of the engine: the step before it (None: none to count), how long the
        proposer took, for how many rows it drafted."""
        self.steps += 1
        self.rows += rows
        self.proposer_s += seconds
        self._recent.append(seconds)
        if interval is not None:
            self.step_s += interval
            self.intervals += 1
            self._recent_steps.append(interval)

    def summary(self) -> dict[str, Any]:
        """Counts, and milliseconds per step: the proposer's mean, p50, p99 and max (over the
        latest :data:`WINDOW` steps), the engine step's mean and p50."""
        recent = np.array(self._recent) * 1e3
        steps = np.array(self._recent_steps) * 1e3
        pct = lambda a, q: float(np.percentile(a, q)) if len(a) else 0.0  # noqa: E731
        return {
            "steps": self.steps,
            "rows": self.rows,
            "proposer_ms_mean": 1e3 * self.proposer_s / self.steps if self.steps else 0.0,
            "proposer_ms_p50": pct(recent, 50),
            "proposer_ms_p99": pct(recent, 99),
            "proposer_ms_max": float(recent.max()) if len(recent) else 0.0,
            "step_ms_mean": 1e3 * self.step_s / self.intervals if self.intervals else 0.0,
            "step_ms_p50": pct(steps, 50),
        }

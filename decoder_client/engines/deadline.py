"""A draft call's deadline scaled to the engine's step.

A fixed deadline fits no engine: 5 ms is a fifth of a small model's step on a GPU and a few
percent of a CPU engine's, where a late answer from the service still beats the local fallback
(and a missed deadline also has the client skip the service a while). The deadline here is a
fraction of the engine's recent step time (an exponential average of the intervals between its
calls), never below the configured floor nor above the cap: the service being slow costs a step
at most that fraction of itself.

>>> d = StepDeadline(floor_s=0.005, fraction=0.1, cap_s=0.05)
>>> d.seconds  # no step seen yet: the floor
0.005
>>> for t in (0.0, 0.2, 0.4, 0.6):  # 200 ms steps
...     d.step(t)
>>> round(d.seconds, 4)
0.02
>>> d.step(30.0)  # a pause is not a step
>>> round(d.seconds, 4)
0.02
"""

from __future__ import annotations


class StepDeadline:
    """Per-call deadline: ``fraction`` of the engine's mean step, within ``[floor_s, cap_s]``;
    intervals longer than ``idle_s`` are pauses (not counted). ``fraction`` 0: always the floor."""

    def __init__(
        self, *, floor_s: float, fraction: float, cap_s: float, idle_s: float = 2.0, weight: float = 0.1
    ) -> None:
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"need 0 < floor_s <= cap_s, got {floor_s} and {cap_s}")
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        self.floor_s, self.fraction, self.cap_s, self.idle_s, self.weight = floor_s, fraction, cap_s, idle_s, weight
        self._last: float | None = None
        self._mean: float | None = None  # the engine's step, exponentially averaged

    def step(self, now: float) -> None:
        """The engine called at ``now`` (``time.perf_counter()``)."""
        if self._last is not None and 0 < now - self._last <= self.idle_s:
            interval = now - self._last
            self._mean = interval if self._mean is None else self._mean + self.weight * (interval - self._mean)
        self._last = now

    @property
    def seconds(self) -> float:
        if self._mean is None:
            return self.floor_s
        return min(self.cap_s, max(self.floor_s, self.fraction * self._mean))

"""A draft call's deadline scaled to the engine's step.

A fixed deadline fits no engine: 5 ms is a fifth of a small model's step on a GPU and a few
percent of a CPU engine's, where a late answer from the service still beats the local fallback
(and missed deadlines in a row have the client skip the service a while). The deadline here is a
fraction of the engine's recent step time (an exponential average of its steps, as
:class:`~decoder_client.engines.step_clock.StepClock` reads them), never below the configured
floor nor above the cap: the service being slow costs a step at most that fraction of itself.

>>> d = StepDeadline(floor_s=0.005, fraction=0.1, cap_s=0.05)
>>> d.seconds  # no step seen yet: the floor
0.005
>>> for _ in range(3):  # 200 ms steps
...     d.step(0.2)
>>> round(d.seconds, 4)
0.02
>>> d.step(None)  # a pause (or the first call) is not a step
>>> round(d.seconds, 4)
0.02
"""

from __future__ import annotations


class StepDeadline:
    """Per-call deadline: ``fraction`` of the engine's mean step, within ``[floor_s, cap_s]``.
    ``fraction`` 0: always the floor."""

    def __init__(self, *, floor_s: float, fraction: float, cap_s: float, weight: float = 0.1) -> None:
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"need 0 < floor_s <= cap_s, got {floor_s} and {cap_s}")
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        self.floor_s, self.fraction, self.cap_s, self.weight = floor_s, fraction, cap_s, weight
        self._mean: float | None = None  # the engine's step, exponentially averaged

    def step(self, interval: float | None) -> None:
        """The engine's last step took ``interval`` seconds (None: no step to count)."""
        if interval is not None:
            self._mean = interval if self._mean is None else self._mean + self.weight * (interval - self._mean)

    @property
    def seconds(self) -> float:
        if self._mean is None:
            return self.floor_s
        return min(self.cap_s, max(self.floor_s, self.fraction * self._mean))

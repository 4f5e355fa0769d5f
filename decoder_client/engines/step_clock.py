"""The engine's steps as a proposer sees them: the time between the starts of two consecutive
calls.

An engine calls its proposer once per step, so the interval between two calls is one step (the
proposer's own time included). A longer gap than ``idle_s`` is a pause (the engine had nothing
to do), not a step, and the first call has nothing before it. One clock per proposer: the
step's deadline, its cost line and its reported timings all read the same interval.

>>> clock = StepClock(idle_s=1.0)
>>> clock.tick(10.0) is None  # the first call
True
>>> round(clock.tick(10.02), 3)
0.02
>>> clock.tick(30.0) is None  # a pause
True
"""

from __future__ import annotations


class StepClock:
    """Intervals between an engine's calls; see the module docstring."""

    def __init__(self, idle_s: float) -> None:
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.idle_s = idle_s
        self._last: float | None = None

    def tick(self, now: float) -> float | None:
        """The engine called at ``now`` (``time.perf_counter()``): the step since its last call,
        or None (its first call, or after a pause)."""
        last, self._last = self._last, now
        if last is None or not 0 < now - last <= self.idle_s:
            return None
        return now - last

"""What the engine benchmark's runners hand its driver (:mod:`benchmarks.engines_bench`): one
request's outcome as the engine reports it, and the shape of an engine with its methods loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

PLAIN = "plain"  # every engine's reference: plain greedy decoding


@dataclass
class Measurement:
    """One method on one prompt, as the engine reports it."""

    tokens: list[int]  # generated ids
    seconds: float  # the whole request, prompt evaluation included
    steps: int = 0  # verification steps that carried a draft (the engine's counter)
    drafted: int = 0  # draft tokens proposed in those steps
    accepted: int = 0  # of those, accepted
    decode_seconds: float | None = None  # first generated token to the last, when the engine says
    draft_seconds: float | None = None  # inside the drafter, when the runner measures it per call


class Runner(Protocol):
    """An engine with every method loaded, ready to decode one prompt at a time."""

    engine: str
    methods: tuple[str, ...]  # PLAIN first
    unavailable: dict[str, str]  # methods not measured here, and why

    def run(self, method: str, ids: Sequence[int]) -> Measurement: ...

    def begin_workload(self) -> None:
        """Called before a workload's first prompt (the runner snapshots its own counters)."""

    def workload_notes(self, method: str) -> dict[str, Any]:
        """Extra keys for ``method``'s line of the workload just run (settings, proposer time)."""

    def close(self) -> None: ...


@runtime_checkable
class BatchRunner(Runner, Protocol):
    """An engine that also runs prompts as concurrent requests."""

    def run_batch(self, method: str, prompts: Sequence[Sequence[int]]) -> list[Measurement]:
        """These prompts at once, a measurement each: the batch's time and counters shared out
        (see :func:`share_batch`)."""
        ...


def share_batch(
    tokens: Sequence[list[int]],
    seconds: float,
    decode_seconds: Sequence[float | None],
    steps: int,
    drafted: int,
    accepted: int,
) -> list[Measurement]:
    """One batch's outcome as a measurement per request: each request's own tokens and decode
    time, the batch's wall time shared by tokens (so the method's tokens/s is the batch's), and
    the engine's counters, which it keeps for the batch as a whole, on the first.

    >>> ms = share_batch([[1, 2, 3], [4]], 2.0, [0.5, None], steps=2, drafted=8, accepted=3)
    >>> [(m.seconds, m.steps, m.accepted, m.decode_seconds) for m in ms]
    [(1.5, 2, 3, 0.5), (0.5, 0, 0, None)]
    """
    total = sum(len(t) for t in tokens) or 1
    return [
        Measurement(
            list(t),
            seconds * len(t) / total,
            steps=steps if i == 0 else 0,
            drafted=drafted if i == 0 else 0,
            accepted=accepted if i == 0 else 0,
            decode_seconds=d,
        )
        for i, (t, d) in enumerate(zip(tokens, decode_seconds, strict=True))
    ]

"""What the engine benchmark's runners hand its driver (:mod:`benchmarks.engines_bench`): one
request's outcome as the engine reports it, and the shape of an engine with its methods loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

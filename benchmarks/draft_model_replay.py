"""Chains from a draft model in replay (see :mod:`benchmarks.draft_rows`): the model alone, and
the model beside our chain mode.

Both read the rows of each request in replay order (``start`` takes the next request's). The
mix proposes whichever chain's first token is likelier. The model's first-token probability is
the one number about its chain that the context alone decides: deeper ones would read the
trace's text where the chain has already left it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchmarks.draft_rows import SegmentRows
from benchmarks.replay import ReplayDrafter, takes_topk
from indexer.tree_builder import DraftTree, Tier


class _Rows:
    """The rows of each request in turn, and the position reached in the current one."""

    def __init__(self, rows: Sequence[SegmentRows]) -> None:
        self._rows = list(rows)
        self._next = 0
        self.current: SegmentRows | None = None
        self.pos = 0

    def start(self) -> None:
        if self._next >= len(self._rows):
            raise ValueError(f"draft rows for {len(self._rows)} requests; replay asked for more")
        self.current = self._rows[self._next]
        self._next += 1
        self.pos = 0

    def _active(self) -> SegmentRows:
        if self.current is None:
            raise RuntimeError("no request in progress: call start() first")
        return self.current

    def chain(self, k: int) -> np.ndarray:
        tokens = self._active().chain(self.pos, k)
        gone = np.flatnonzero(tokens < 0)  # a position nothing predicted (a stream's first)
        return tokens[: gone[0]] if gone.size else tokens

    def first_prob(self) -> float:
        return self._active().first_prob(self.pos)


class DraftModelChain:
    """A draft model's greedy chains of at most ``k`` tokens (vLLM's draft-model method, say).

    >>> rows = [SegmentRows(np.array([[4], [5], [9]], np.int32), np.zeros((3, 1), np.float32))]
    >>> d = DraftModelChain(rows, 2, name="m")
    >>> d.start(np.array([1], np.int32)); d.propose().tokens.tolist()
    [4, 5]
    >>> d.advance(np.array([4, 5, 6], np.int32)); d.propose().tokens.tolist()
    []
    """

    def __init__(self, rows: Sequence[SegmentRows], k: int, *, name: str = "draft-model") -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.name = f"{name}/greedy({k})"
        self._rows = _Rows(rows)
        self._k = k

    def start(self, prompt: np.ndarray) -> None:
        self._rows.start()

    def propose(self) -> DraftTree:
        return DraftTree.chain(self._rows.chain(self._k), Tier.CONTEXT)

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        self._rows.pos += int(tokens.size)

    def finish(self, commit_from: int) -> None:
        self._rows.current = None


class WithDraftModel:
    """Our chains beside a draft model's: each step, the chain whose first token is likelier,
    the model's by its own probability, ours by its calibrated chance (the reach of its first
    node); the model's where ours is empty. Ours advance on every step either way, as a decoder
    that drafts with both commits what the target produced.

    >>> class Ours:  # a stand-in for the engine: always proposes [7, 8], the first 0.5 likely
    ...     name = "ours"
    ...     def start(self, prompt): pass
    ...     def propose(self):
    ...         return DraftTree(np.array([7, 8], np.int32), np.array([-1, 0], np.int32),
    ...                          np.zeros(2, np.uint8), np.array([0.5, 0.3], np.float32))
    ...     def advance(self, tokens): pass
    ...     def finish(self, commit_from): pass
    >>> logp = np.log(np.array([[0.9], [0.2]], np.float32))
    >>> d = WithDraftModel(Ours(), [SegmentRows(np.array([[4], [5]], np.int32), logp)], 4)
    >>> d.start(np.array([1], np.int32)); d.propose().tokens.tolist()
    [4, 5]
    >>> d.advance(np.array([4], np.int32)); d.propose().tokens.tolist()
    [7, 8]
    """

    def __init__(self, inner: ReplayDrafter, rows: Sequence[SegmentRows], k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.name = f"{inner.name}+draft-model"
        self._inner = inner
        self._inner_takes_topk = takes_topk(inner)
        self._rows = _Rows(rows)
        self._k = k
        self.model_steps = 0  # steps that proposed the model's chain
        self.steps = 0

    def start(self, prompt: np.ndarray) -> None:
        self._inner.start(prompt)
        self._rows.start()

    def propose(self) -> DraftTree:
        ours = self._inner.propose()  # drafted every step, so the engine's session stays in step
        self.steps += 1
        model = self._rows.chain(self._k)
        if not model.size or (len(ours) and self._rows.first_prob() < float(ours.scores[0])):
            return ours
        self.model_steps += 1
        return DraftTree.chain(model, Tier.CONTEXT)

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        if topk is not None and self._inner_takes_topk:
            self._inner.advance(tokens, topk=topk)
        else:
            self._inner.advance(tokens)
        self._rows.pos += int(tokens.size)

    def finish(self, commit_from: int) -> None:
        self._inner.finish(commit_from)
        self._rows.current = None

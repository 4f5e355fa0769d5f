"""Chains from a draft model in replay: the model alone, and the model beside our chain mode.

Two ways to get the model's chains. From rows (:mod:`benchmarks.draft_rows`), exact where the
model reads the traces' ids: each drafter reads the rows of each request in replay order
(``start`` takes the next request's); the model's first-token probability is the one number
about its chain that the context alone decides, deeper ones would read the trace's text where
the chain has already left it. Or live (:class:`LiveDraftModel`, :class:`LiveWithDraftModel`):
the model runs at every step (:class:`decoder_client.chain_model.ChainSource`), as a decoder
runs it, behind another tokenizer too (:class:`decoder_client.retokenized.Retokenized`). The mix
proposes whichever chain is expected to have more tokens accepted, by the rule the decoders use
(:func:`decoder_client.chain_model.model_goes`). For long runs the live model may skip its reads
past a chain's first wrong token (:mod:`benchmarks.trace_cut`): each request's output is then
revealed to it as the request starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchmarks.draft_rows import SegmentRows
from benchmarks.replay import ReplayDrafter, takes_topk
from benchmarks.trace_cut import TraceCut
from decoder_client.chain_model import BesideCache, ChainSource, ModelRecord, expected_accepted, model_chain, model_goes
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
    """Our chains beside a draft model's: each step, the chain expected to have more tokens
    accepted, the model's by its track record
    (:class:`~decoder_client.chain_model.ModelRecord`, told the target's token at every step and
    how far each of its proposed chains went), ours by its calibrated chances (the sum of its
    nodes' reaches); the model's where ours is empty. Ours advance on every step either way, as a decoder
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
        self.record = ModelRecord()  # how often the model's first token was the target's, how far its chains went
        # the model's first token this step, its probability, and its chain if proposed
        self._asked: tuple[int, float, np.ndarray | None] | None = None

    def start(self, prompt: np.ndarray) -> None:
        self._inner.start(prompt)
        self._rows.start()
        self._asked = None

    def propose(self) -> DraftTree:
        ours = self._inner.propose()  # drafted every step, so the engine's session stays in step
        self.steps += 1
        model = self._rows.chain(self._k)
        self._asked = None
        if not model.size:
            return ours
        prob = self._rows.first_prob()
        self._asked = (int(model[0]), prob, None)
        first = self.record.next_token(int(model[0]), prob)
        if len(ours) and not model_goes(first, expected_accepted(ours), int(model.size)):
            return ours
        self.model_steps += 1
        self._asked = (int(model[0]), prob, model)
        return DraftTree.chain(model, Tier.CONTEXT)

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        if self._asked is not None and tokens.size:
            token, prob, chain = self._asked
            self.record.outcome(prob, token, chain, tokens)
            self._asked = None
        _advance(self._inner, self._inner_takes_topk, tokens, topk)
        self._rows.pos += int(tokens.size)

    def finish(self, commit_from: int) -> None:
        self._inner.finish(commit_from)
        self._rows.current = None


class _Context:
    """The current request's ids: its prompt, then what each step yielded."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._ids: np.ndarray | None = None

    def start(self, prompt: np.ndarray) -> None:
        self._parts, self._ids = [np.asarray(prompt, dtype=np.int32)], None

    def add(self, tokens: np.ndarray) -> None:
        self._parts.append(np.asarray(tokens, dtype=np.int32))
        self._ids = None

    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._ids = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=np.int32)
            self._parts = [self._ids]
        return self._ids


class LiveDraftModel:
    """A draft model's greedy chains of at most ``k`` tokens, the model run at every step."""

    def __init__(self, model: ChainSource, k: int, *, name: str = "draft-model") -> None:
        self.name = f"{name}/live({k})"
        self._model = model
        self._context = _Context()

    def start(self, prompt: np.ndarray) -> None:
        self._context.start(prompt)

    def reveal(self, output: np.ndarray) -> None:
        _reveal(self._model, self._context, output)

    def propose(self) -> DraftTree:
        if self._model.first(self._context.ids()) is None:
            return DraftTree.empty()
        return model_chain(*self._model.extend())

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        self._context.add(tokens)

    def finish(self, commit_from: int) -> None:
        self._context.start(np.zeros(0, dtype=np.int32))


class LiveWithDraftModel:
    """Our chains beside a draft model run at every step, by the decoders' own drafter
    (:class:`decoder_client.chain_model.BesideCache`): the model's chain unless more of ours is
    expected to be accepted, ours where the model gives none. Ours advance on every step."""

    def __init__(self, inner: ReplayDrafter, model: ChainSource, *, name: str = "draft-model") -> None:
        self.name = f"{inner.name}+{name}/live"
        self._inner = inner
        self._inner_takes_topk = takes_topk(inner)
        self._beside = BesideCache(lambda context: inner.propose(), model)
        self._context = _Context()

    @property
    def model_steps(self) -> int:
        return self._beside.model_steps

    @property
    def steps(self) -> int:
        return self._beside.steps

    def start(self, prompt: np.ndarray) -> None:
        self._inner.start(prompt)
        self._context.start(prompt)

    def reveal(self, output: np.ndarray) -> None:
        _reveal(self._beside.model, self._context, output)

    def propose(self) -> DraftTree:
        return self._beside(self._context.ids())

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        _advance(self._inner, self._inner_takes_topk, tokens, topk)
        self._context.add(tokens)

    def finish(self, commit_from: int) -> None:
        self._inner.finish(commit_from)
        self._context.start(np.zeros(0, dtype=np.int32))


def _reveal(model: ChainSource, context: _Context, output: np.ndarray) -> None:
    """The request's whole ids to a model that cuts its chains where they leave them."""
    if isinstance(model, TraceCut):
        model.reveal(np.concatenate([context.ids(), np.asarray(output, dtype=np.int32)]))


def _advance(inner: ReplayDrafter, takes: bool, tokens: np.ndarray, topk: np.ndarray | None) -> None:
    """The step's tokens to ``inner``, with the target's top-k where it takes them."""
    if topk is not None and takes:
        inner.advance(tokens, topk=topk)
    else:
        inner.advance(tokens)

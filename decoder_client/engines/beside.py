"""A draft model's chain in an engine's proposal, beside the cache's (the rule of
:mod:`decoder_client.chain_model`), and the per-request draft models of an engine that batches.

:func:`beside` is the step's choice, as every engine adapter makes it: the model's chain where
more of it is expected to be accepted than of the cache's, cut where a token is less likely than
the engine's cut to be reached, as the cache's chains are. Its tokens carry no claims: the model's
probabilities are its own, and the outcomes that correct the cache's claims
(:class:`~decoder_client.engines.outcomes.ChainOutcomes`) must not learn from them.

:class:`ModelRows` keeps one :class:`~decoder_client.chain_model.ChainModel` per request of a
batch: each holds its own KV cache along its request, so a step reads only the request's new
tokens, and :meth:`ModelRows.beside` reads the whole batch's together (one forward per depth
where the model's class can share one, as :mod:`decoder_client.draft_model`'s does). A cache
is memory (for a 135M model in float32, about 46 KB a token), so at most ``limit`` requests
draft beside the model at once; the others draft from the cache alone until one of those ends.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from decoder_client.chain_model import (
    ChainModel,
    ChainSource,
    NextToken,
    expected_tokens,
    extend_many,
    first_many,
    model_goes,
)
from decoder_client.engines.step_cost import cut


class Proposal(NamedTuple):
    """One request's chain this step: its tokens, the cache's claims for them (empty for the
    model's), each token's chance of being reached, and whether it is the model's."""

    chain: np.ndarray
    claims: np.ndarray
    scores: np.ndarray
    model: bool


def beside(
    model: ChainSource,
    context: np.ndarray,
    chain: np.ndarray,
    claims: np.ndarray,
    scores: np.ndarray,
    max_len: int,
    min_prob: float,
) -> Proposal:
    """The cache's chain (``chain``, ``claims``, ``scores``, as
    :func:`~decoder_client.engines.step_cost.chain_to_propose` gives them) or the model's after
    ``context``, whichever is expected to have more tokens accepted; the model's is at most
    ``max_len`` tokens, cut at ``min_prob`` (its tokens by the model's record). The model reads
    ``context`` either way (its cache follows the request).

    >>> from decoder_client.chain_model import NextToken
    >>> class Sure:  # a model sure of 7, 8, then less so
    ...     k, vocab_size = 4, 16
    ...     def first(self, context): return NextToken(7, 0.9)
    ...     def extend(self, min_prob): return np.array([7, 8, 9, 10]), np.array([0.9, 0.9, 0.2, 0.5])
    >>> ours = np.array([3, 4]), np.array([0.5, 0.4]), np.array([0.5, 0.4])
    >>> p = beside(Sure(), np.array([1, 2]), *ours, max_len=4, min_prob=0.1)
    >>> p.chain.tolist(), p.claims.size, p.model
    ([7, 8, 9], 0, True)
    >>> longer = np.array([3, 4, 5, 6]), np.full(4, 0.9), np.array([0.95, 0.9, 0.85, 0.8])  # 3.5 expected
    >>> beside(Sure(), np.array([1, 2]), *longer, 4, 0.1).model  # against the model's 3.1
    False
    """
    ours = Proposal(chain, claims, scores, False)
    if not _model_goes(model.first(context), ours, max_len, min_prob):
        return ours
    return _model_proposal(ours, *model.extend(min_prob), max_len, min_prob)


def _model_goes(nxt: NextToken | None, ours: Proposal, max_len: int, min_prob: float) -> bool:
    """The rule for one request: the model's chain of at most ``max_len``, cut at ``min_prob``,
    against the cache's chain (each token's chance of being reached adds to what is expected)."""
    return model_goes(nxt, expected_tokens(ours.scores), max_len, at_least=min_prob)


def _model_proposal(ours: Proposal, tokens: np.ndarray, probs: np.ndarray, max_len: int, min_prob: float) -> Proposal:
    """The model's chain (``tokens``, each one's ``probs``) cut as the cache's are; ``ours``
    where it gave none after all."""
    if not tokens.size:
        return ours
    likely = np.cumprod(probs[:max_len].astype(np.float64))
    tokens = cut(tokens[:max_len], likely, min_prob)
    return Proposal(tokens, np.zeros(0), likely[: tokens.size], True)


class ModelRows:
    """A draft model per running request, made by ``make`` (each with its own KV cache, the
    weights shared), at most ``limit`` at once; a request that ends gives its model back.

    >>> class Model:  # a ChainModel's part that ModelRows uses on its own
    ...     def reset(self): pass
    >>> rows = ModelRows(Model, limit=1)
    >>> a = rows.get("a")
    >>> rows.get("a") is a, rows.get("b") is None  # "b" waits: the one model is held
    (True, True)
    >>> rows.release(["a"])
    >>> rows.get("b") is a, rows.live
    (True, 1)
    """

    def __init__(self, make: Callable[[], ChainModel], limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._make = make
        self.limit = limit
        self._held: dict[Hashable, ChainModel] = {}
        self._free: list[ChainModel] = []
        self._made: list[ChainModel] = []
        self.reads = 0  # reads of the batch: one for the step's contexts, one per depth of its chains

    def beside(
        self,
        requests: Sequence[Hashable],
        contexts: Sequence[np.ndarray],
        ours: Sequence[Proposal],
        max_lens: Sequence[int],
        min_prob: float,
    ) -> list[Proposal]:
        """:func:`beside` for a batch: each request's proposal (``ours``: the cache's chain,
        claims and chances), the model's chain where it holds a model and more of its chain is
        expected to be accepted. The models read every context and chain of the batch together."""
        held = [(i, m) for i, r in enumerate(requests) if (m := self.get(r)) is not None]
        nexts = first_many([m for _, m in held], [contexts[i] for i, _ in held])
        self.reads += 1 if held else 0
        going = [
            (i, m) for (i, m), nxt in zip(held, nexts, strict=True) if _model_goes(nxt, ours[i], max_lens[i], min_prob)
        ]
        chains = extend_many([m for _, m in going], min_prob)
        self.reads += max((t.size - 1 for t, _ in chains), default=0)
        out = list(ours)
        for (i, _), (tokens, probs) in zip(going, chains, strict=True):
            out[i] = _model_proposal(ours[i], tokens, probs, max_lens[i], min_prob)
        return out

    def get(self, request: Hashable) -> ChainModel | None:
        """``request``'s model: the one it holds, else a free one, else a new one while fewer
        than ``limit`` are held; ``None`` when all are."""
        model = self._held.get(request)
        if model is not None:
            return model
        if self._free:
            model = self._free.pop()
        elif len(self._made) < self.limit:
            model = self._make()
            self._made.append(model)
        else:
            return None
        self._held[request] = model
        return model

    def release(self, requests: Iterable[Hashable]) -> None:
        """These requests ended: their models forget them and are free for others."""
        for request in requests:
            model = self._held.pop(request, None)
            if model is not None:
                model.reset()  # its cache's memory goes now, not at the next request
                self._free.append(model)

    @property
    def live(self) -> int:
        """Requests holding a model now."""
        return len(self._held)

    @property
    def forwards(self) -> int:
        """Forward passes of every model made, a request's share of a batch's counted as one
        of its own."""
        return sum(m.forwards for m in self._made)

    @property
    def fed(self) -> int:
        """Tokens those passes read."""
        return sum(m.fed for m in self._made)

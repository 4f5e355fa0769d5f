"""A small draft model's greedy chains, beside the cache's drafts: the rule that picks one each
step, and what any engine's draft model must give it.

Chains lose to trees at their first token: a chain has one, a tree hedges. A small causal LM
that reads the target's ids (the same tokenizer) knows the next token where the cache's memory
does not, and the cache knows long verbatim runs where the model is unsure; on agent traffic
each is right where the other is not (docs/MEASUREMENTS.md, "Chains beside a draft model").
Each step proposes the model's chain unless the cache's first token is likelier: the model's by
the probability it gives its own first token, as often as that probability has been right so far
(:class:`FirstTokenRecord`: a model learns, step by step, how often its first token was the
target's), the cache's by its calibrated chance (the reach of its roots, which every draft
carries as its scores). Its replay is :class:`benchmarks.draft_model_replay.WithDraftModel`.

A :class:`ChainModel` costs one forward per step over the tokens it has not read (the step's
accepted ones and the sampled one), and ``k - 1`` more only on the steps its chain is proposed.
It keeps its own KV cache along the request: tokens it drafted and the target accepted are
already in it, and a context that went elsewhere (another request, a rejected draft) rewinds
the cache to what the two share. This module needs neither torch nor an engine:
:mod:`decoder_client.draft_model` runs a Hugging Face model,
:mod:`decoder_client.engines.llamacpp_chains` a llama.cpp one.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from indexer.drafter import MAX_DEPTH
from indexer.tokens import as_tokens
from indexer.tree_builder import DraftTree, Tier

Drafter = Callable[[np.ndarray], DraftTree]

# The model's chain continues the request's own text, as the model reads it: it is labelled
# with the context tier, the nearest of the cache's tiers. Nothing downstream calibrates on it.
MODEL_TIER = Tier.CONTEXT


def first_token_chance(tree: DraftTree) -> float:
    """The chance that a draft's first token is right: its roots are distinct guesses at the
    same position, so their reaches add up.

    >>> tree = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, 0, -1], np.int32),
    ...                  np.zeros(3, np.uint8), np.array([0.5, 0.4, 0.25], np.float32))
    >>> first_token_chance(tree)
    0.75
    >>> first_token_chance(DraftTree.empty())
    0.0
    """
    if len(tree) == 0:
        return 0.0
    return float(min(1.0, float(tree.scores[tree.parents == -1].sum())))


@dataclass(frozen=True)
class NextToken:
    """The model's greedy next token after a context, the probability it gives it, and its
    chance of being the target's next token by the model's track record (``None``: the
    probability stands for it; see :class:`FirstTokenRecord`)."""

    token: int
    prob: float
    chance: float | None = None

    @property
    def likely(self) -> float:
        """The chance the beside rule weighs against the cache's."""
        return self.prob if self.chance is None else self.chance


class FirstTokenRecord:
    """How often a model's first token, given probability ``p`` by the model, was the target's
    next token: counted by bins of ``p``, and each bin's rate pulled toward ``p`` itself by
    :data:`PULL` steps' worth, so that a claim stands as made until steps say otherwise.

    A model's own probabilities are not the chance that the target writes its token: a model
    much smaller than its target is often surer than it is right, and a quantized copy of the
    target is right far more often than its probabilities say.

    >>> record = FirstTokenRecord()
    >>> record.chance(0.55)  # nothing seen: the claim
    0.55
    >>> for _ in range(40):
    ...     record.add(0.55, True)  # right every time
    >>> round(record.chance(0.55), 3), record.chance(0.95)  # another bin: nothing seen there
    (0.925, 0.95)
    """

    BINS = 10
    PULL = 8.0

    def __init__(self) -> None:
        self.seen = np.zeros(self.BINS)
        self.right = np.zeros(self.BINS)

    def _bin(self, prob: float) -> int:
        return min(self.BINS - 1, max(0, int(prob * self.BINS)))

    def add(self, prob: float, right: bool) -> None:
        b = self._bin(prob)
        self.seen[b] += 1
        self.right[b] += right

    def chance(self, prob: float) -> float:
        b = self._bin(prob)
        return float((self.right[b] + self.PULL * prob) / (self.seen[b] + self.PULL))


class ChainSource(Protocol):
    """What drafts beside the cache: a :class:`ChainModel`, or one behind another tokenizer
    (:class:`decoder_client.retokenized.Retokenized`)."""

    k: int
    vocab_size: int  # the target's ids it reads

    def first(self, context: np.ndarray) -> NextToken | None:
        """The model's first token after ``context`` and its probability; ``None``: no chain here."""

    def extend(self, min_prob: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """The chain in the target's ids from that token, and each token's chance given the one
        before; empty where the model gives none after all. It may end once its chance of being
        reached falls below ``min_prob`` (a proposal cut there would drop the rest)."""


def model_goes(model: NextToken | None, cache_chance: float) -> bool:
    """Whether the model's chain is proposed: it has one, and its first token is at least as
    likely as the cache's (0 where the cache has nothing), by the model's track record where
    it has one.

    >>> model_goes(NextToken(5, 0.4), 0.3), model_goes(NextToken(5, 0.2), 0.3), model_goes(None, 0.0)
    (True, False, False)
    >>> model_goes(NextToken(5, 0.2, chance=0.9), 0.3)  # right far more often than it says
    True
    """
    return model is not None and model.likely >= cache_chance


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share.

    >>> shared_prefix(np.array([1, 2, 3], np.int32), np.array([1, 2, 4, 5], np.int32))
    2
    """
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class ChainModel(abc.ABC):
    """Greedy chains of at most ``k`` tokens from a causal LM that reads the target's ids.

    :meth:`first` reads a context and gives the model's next token; :meth:`extend` goes on from
    it to a whole chain. A context longer than the model's positions allow (with room for the
    chain) gets no token: the cache drafts alone there. An engine's model implements
    :meth:`_feed` (read ids after what its cache holds; the next token's distribution) and
    :meth:`_rewind` (keep the first ``n`` ids in its cache).
    """

    def __init__(self, k: int, vocab_size: int, max_positions: int | None) -> None:
        if not 1 <= k <= MAX_DEPTH:
            raise ValueError(f"k must be in [1, {MAX_DEPTH}], got {k}")
        self.k = k
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self._held = np.zeros(0, dtype=np.int32)  # the ids whose keys and values the cache holds
        self._next: NextToken | None = None  # what first() gave for the context it last read
        # ... and that context's length, until the next context shows the target's token there
        self._asked: tuple[int, NextToken] | None = None
        self.record = FirstTokenRecord()  # how often its first tokens were the target's
        self.forwards = 0  # forward passes, for what drafting cost
        self.fed = 0  # tokens those passes read

    @abc.abstractmethod
    def _feed(self, ids: np.ndarray) -> np.ndarray:
        """Read ``ids`` after what the cache holds; the next token's probabilities (float)."""

    @abc.abstractmethod
    def _rewind(self, n: int) -> None:
        """Keep only the first ``n`` ids' entries in the cache."""

    @classmethod
    def _feed_many(cls, models: Sequence[ChainModel], feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        """:meth:`_feed` for several of this class's models at once (each its own ids after its
        own cache). One at a time here; a class whose models can share a forward overrides it."""
        return [m._feed(ids) for m, ids in zip(models, feeds, strict=True)]

    def first(self, context: np.ndarray) -> NextToken | None:
        """The model's next token after ``context`` (int32 ids), or ``None`` where the context
        and a chain of ``k`` would not fit the model's positions."""
        return first_many([self], [context])[0]

    def extend(self, min_prob: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """The chain from the token :meth:`first` last gave, greedy up to ``k`` tokens, and the
        probability the model gave each of its tokens; it ends at the first token whose chance
        of being reached (the product of the probabilities up to it) is below ``min_prob``,
        without reading further."""
        return extend_many([self], min_prob)[0]

    def chain(self, context: np.ndarray) -> np.ndarray:
        """The model's greedy chain of ``k`` after ``context``; empty where it does not fit."""
        if self.first(context) is None:
            return np.zeros(0, dtype=np.int32)
        return self.extend()[0]

    def reset(self) -> None:
        """Forget the cache (a new request shares nothing with the last)."""
        self._rewind(0)
        self._held = np.zeros(0, dtype=np.int32)
        self._next = self._asked = None

    def _start(self, context: np.ndarray) -> np.ndarray | None:
        """Check ``context``, rewind the cache to what it shares with it, and give the ids left
        to read (at least the last, for its logits); ``None`` where it does not fit."""
        ctx = as_tokens(context, self.vocab_size, what="context")
        if ctx.size == 0:
            raise ValueError("context must not be empty")
        self._next = None
        held = shared_prefix(self._held, ctx)
        if self._asked is not None:  # the target's token where the model's first one was
            at, nxt = self._asked
            if ctx.size > at and held >= at:
                self.record.add(nxt.prob, int(ctx[at]) == nxt.token)
            self._asked = None
        if self.max_positions is not None and ctx.size + self.k > self.max_positions:
            self.reset()
            return None
        shared = min(held, ctx.size - 1)  # the last id is read again for its logits
        if shared < self._held.size:
            self._rewind(shared)
        self._held = ctx.copy()
        return ctx[shared:]


def read_many(models: Sequence[ChainModel], feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each model reads its ids (in one forward where their class can share one); each one's
    next-token probabilities. A failed read starts every model in it over: a cache may hold
    part of what it was fed.
    """
    if len({id(m) for m in models}) != len(models):
        raise ValueError("a model may read only once in a batch")
    for m, ids in zip(models, feeds, strict=True):
        m.forwards += 1
        m.fed += int(ids.size)
    kinds = {type(m) for m in models}
    try:
        if len(kinds) == 1:
            return kinds.pop()._feed_many(models, feeds)
        return [m._feed(ids) for m, ids in zip(models, feeds, strict=True)]
    except BaseException:
        for m in models:
            m.reset()
        raise


def first_many(models: Sequence[ChainModel], contexts: Sequence[np.ndarray]) -> list[NextToken | None]:
    """:meth:`ChainModel.first` for each model and its context (distinct models), read together."""
    feeds = [m._start(c) for m, c in zip(models, contexts, strict=True)]
    fit = [i for i, f in enumerate(feeds) if f is not None]
    out: list[NextToken | None] = [None] * len(models)
    probs = read_many([models[i] for i in fit], [feeds[i] for i in fit])  # type: ignore[misc]
    for i, p in zip(fit, probs, strict=True):
        token = int(np.argmax(p))
        m, prob = models[i], float(p[token])
        nxt = NextToken(token, prob, m.record.chance(prob))
        m._next = out[i] = nxt
        m._asked = (int(m._held.size), nxt)
    return out


def extend_many(models: Sequence[ChainModel], min_prob: float = 0.0) -> list[tuple[np.ndarray, np.ndarray]]:
    """:meth:`ChainModel.extend` for each model (distinct models), one read of all the chains
    still going per depth."""
    tokens: list[list[int]] = []
    probs: list[list[float]] = []
    for m in models:
        if m._next is None:
            raise RuntimeError("no next token to extend: call first() with a context that fits")
        tokens.append([m._next.token])
        probs.append([m._next.prob])
    reach = [p[0] for p in probs]
    going = [i for i, m in enumerate(models) if m.k > 1 and reach[i] >= min_prob]
    while going:
        read = read_many([models[i] for i in going], [np.array(tokens[i][-1:], dtype=np.int32) for i in going])
        for i, p in zip(going, read, strict=True):
            m = models[i]
            m._held = np.append(m._held, np.int32(tokens[i][-1]))
            token = int(np.argmax(p))
            tokens[i].append(token)
            probs[i].append(float(p[token]))
            reach[i] *= probs[i][-1]
        going = [i for i in going if len(tokens[i]) < models[i].k and reach[i] >= min_prob]
    for m in models:
        m._next = None
    return [(np.array(t, dtype=np.int32), np.array(p, dtype=np.float32)) for t, p in zip(tokens, probs, strict=True)]


def model_chain(tokens: np.ndarray, probs: np.ndarray) -> DraftTree:
    """The model's chain as a draft, each token scored by the product of the model's
    probabilities up to it (its own estimate of reaching it)."""
    n = tokens.size
    return DraftTree(
        tokens.astype(np.int32),
        np.arange(-1, n - 1, dtype=np.int32),
        np.full(n, MODEL_TIER, dtype=np.uint8),
        np.cumprod(probs).astype(np.float32),
    )


class BesideCache:
    """A reference-decoder drafter: the cache's drafts (``cache``, any drafter) beside a draft
    model's chains. Each step proposes the model's chain unless the cache's first token is
    likelier; where the cache has nothing (it is empty there, or down and its client fell
    back), the model's chain goes. The cache is asked every step, so its session follows the
    request whichever draft is verified.

    >>> drafter = BesideCache(cache_drafter, ModelDrafter(small_model, k=8))  # doctest: +SKIP
    >>> tokens, stats = ReferenceDecoder(target).generate(ids, 128, drafter=drafter)  # doctest: +SKIP
    >>> drafter.model_steps / drafter.steps  # doctest: +SKIP
    0.64
    """

    def __init__(self, cache: Drafter, model: ChainSource) -> None:
        self.cache = cache
        self.model = model
        self.steps = 0
        self.model_steps = 0  # steps that proposed the model's chain
        self.accepted = {"model": 0, "cache": 0}  # accepted draft tokens by whose draft it was
        self._last: tuple[DraftTree, str, int] | None = None  # the last draft, whose, at what length

    def __call__(self, context: np.ndarray) -> DraftTree:
        self._count(context)
        ours = self.cache(context)
        nxt = self.model.first(context)
        self.steps += 1
        if not model_goes(nxt, first_token_chance(ours)):
            self._last = (ours, "cache", int(context.size))
            return ours
        tree = model_chain(*self.model.extend())
        if len(tree) == 0:  # the model gave no chain after all
            self._last = (ours, "cache", int(context.size))
            return ours
        self.model_steps += 1
        self._last = (tree, "model", int(context.size))
        return tree

    def _count(self, context: np.ndarray) -> None:
        """Credit the last draft with what the target accepted of it (all the new tokens but the
        last, the step's own); a context that did not grow from it is another request."""
        if self._last is not None:
            tree, whose, at = self._last
            if context.size > at:
                self.accepted[whose] += len(tree.accept(context[at:-1]))
        self._last = None

    def observe_topk(self, verified: object) -> None:
        """Passed on to the cache's drafter, if it takes the target's top-k."""
        observe = getattr(self.cache, "observe_topk", None)
        if observe is not None:
            observe(verified)

"""A small draft model's greedy chains, beside the cache's drafts: the rule that picks one each
step, and what any engine's draft model must give it.

Chains lose to trees at their first token: a chain has one, a tree hedges. A small causal LM
that reads the target's ids (the same tokenizer) knows the next token where the cache's memory
does not, and the cache knows long verbatim runs where the model is unsure; on agent traffic
each is right where the other is not (docs/MEASUREMENTS.md, "Chains beside a draft model").
Each step proposes the model's chain unless more of the cache's draft is expected to be
accepted: the cache's by its calibrated chances (each node's chance of being reached, which
every draft carries as its scores), the model's by its track record (:class:`ModelRecord`: how
often, at the probability the model gave it, its first token was the target's, and how often the
tokens after a right one were right too). Where the decoder knows what a step costs
(:class:`StepCosts`), tokens per second decide instead: the model's chain is worth its
verification and its ``k - 1`` reads only where it brings more. Its replay is
:class:`benchmarks.draft_model_replay.WithDraftModel`.

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
import time
from collections.abc import Callable, Iterable, Sequence
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

# A first read of at most this many tokens a model is a step's catch-up, timed for the beside
# rule's costs; a longer one is a prompt, timed apart (a token of it costs far less).
CATCH_UP = 32


def expected_accepted(tree: DraftTree) -> float:
    """How many of a draft's tokens the target is expected to accept: each node's score is its
    chance of being reached (accepted with its whole root path), so they add up.

    >>> tree = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, 0, -1], np.int32),
    ...                  np.zeros(3, np.uint8), np.array([0.5, 0.4, 0.25], np.float32))
    >>> round(expected_accepted(tree), 3)
    1.15
    >>> expected_accepted(DraftTree.empty())
    0.0
    """
    return expected_tokens(tree.scores)


def expected_tokens(reaches: np.ndarray) -> float:
    """How many of a draft's tokens are expected to be accepted, given each one's chance of
    being reached (a chance above 1 counts as 1)."""
    return float(np.minimum(reaches.astype(np.float64), 1.0).sum())


@dataclass(frozen=True)
class NextToken:
    """The model's greedy next token after a context, the probability it gives it, and, by the
    model's track record (:class:`ModelRecord`; ``None``: the probability stands for it), the
    chance that it is the target's next token and the chance that each token of its chain after
    a right one is right too."""

    token: int
    prob: float
    chance: float | None = None
    onward: float | None = None

    @property
    def likely(self) -> float:
        """The chance that the model's first token is the target's."""
        return self.prob if self.chance is None else self.chance

    def reaches(self, n: int) -> np.ndarray:
        """Each token's chance of being reached, in a chain of ``n`` from this one: the first
        token's chance times the onward chance for each token before it. Their sum is how many
        the target is expected to accept.

        >>> NextToken(5, 0.5, chance=0.8, onward=0.5).reaches(3).round(3).tolist()
        [0.8, 0.4, 0.2]
        """
        q = self.prob if self.onward is None else self.onward
        return self.likely * q ** np.arange(n)


class ModelRecord:
    """How a model's chains have fared against the target, by tenths of the probability ``p``
    the model gave its first token: how often that first token was the target's, and, past a
    right first token, how often each next token of a proposed chain was right too (the tokens
    after the first wrong one are never reached). Each rate is pulled toward a claim by
    :data:`PULL` trials' worth, so that a claim stands as made until steps say otherwise: the
    first token's toward ``p``, the onward rate toward the first token's chance.

    A model's own probabilities are not the chance that the target writes its token: a model
    much smaller than its target is often surer than it is right, and a quantized copy of the
    target is right far more often than its probabilities say. How far its chains go decides
    whether one is worth proposing over the cache's, and costs ``k - 1`` more forwards to find
    out, so the record learns it from the chains that were proposed.

    >>> record = ModelRecord()
    >>> record.chance(0.55), record.onward(0.55)  # nothing seen: the claim
    (0.55, 0.55)
    >>> for _ in range(40):
    ...     record.add(0.55, True)  # right every time ...
    ...     record.add_chain(0.55, [4, 5, 6, 7], [4, 5, 9])  # ... the next one too, then a miss
    >>> round(record.chance(0.55), 3), record.chance(0.95)  # another bin: nothing seen there
    (0.925, 0.95)
    >>> round(record.onward(0.55), 3)  # 40 of 80 onward tokens right, pulled toward 0.925
    0.539
    """

    BINS = 10
    PULL = 8.0

    def __init__(self) -> None:
        self.seen = np.zeros(self.BINS)
        self.right = np.zeros(self.BINS)
        self.onward_seen = np.zeros(self.BINS)
        self.onward_right = np.zeros(self.BINS)

    def _bin(self, prob: float) -> int:
        return min(self.BINS - 1, max(0, int(prob * self.BINS)))

    def add(self, prob: float, right: bool) -> None:
        """A first token given ``prob``, and whether it was the target's."""
        b = self._bin(prob)
        self.seen[b] += 1
        self.right[b] += right

    def add_chain(self, prob: float, chain: Sequence[int] | np.ndarray, truth: Sequence[int] | np.ndarray) -> None:
        """A proposed chain whose first token was given ``prob``, against the target's tokens at
        its positions, as many as are known: its tokens after a right first one, each up to and
        including the first wrong one."""
        n = min(len(chain), len(truth))
        if n < 2 or int(chain[0]) != int(truth[0]):
            return
        miss = np.flatnonzero(np.asarray(chain[1:n]) != np.asarray(truth[1:n]))
        right = int(miss[0]) if miss.size else n - 1
        b = self._bin(prob)
        self.onward_seen[b] += right + (1 if miss.size else 0)
        self.onward_right[b] += right

    def outcome(
        self, prob: float, first: int, chain: Sequence[int] | np.ndarray | None, truth: Sequence[int] | np.ndarray
    ) -> None:
        """What the target produced (``truth``, at least one token) where the model's first token
        was ``first``, given ``prob``: :meth:`add`, and :meth:`add_chain` where its ``chain`` was
        proposed (``None``: not)."""
        self.add(prob, int(truth[0]) == first)
        if chain is not None:
            self.add_chain(prob, chain, truth)

    def chance(self, prob: float) -> float:
        """The chance that a first token given ``prob`` is the target's."""
        b = self._bin(prob)
        return float((self.right[b] + self.PULL * prob) / (self.seen[b] + self.PULL))

    def onward(self, prob: float) -> float:
        """The chance that a token of the chain after a right one is right, where the first token
        was given ``prob``."""
        b = self._bin(prob)
        return float((self.onward_right[b] + self.PULL * self.chance(prob)) / (self.onward_seen[b] + self.PULL))

    def next_token(self, token: int, prob: float) -> NextToken:
        """``token``, given ``prob`` by the model, with its chances by this record."""
        return NextToken(token, prob, self.chance(prob), self.onward(prob))


class DraftRecord:
    """How many of the cache's draft tokens the target accepted against how many its chances
    said, by bands of the expected count: each band's ratio of the two sums, pulled toward 1 by
    :data:`PULL` drafts' worth at the claim in question. A draft's chances are calibrated for
    drafts in general, not for this target beside this model; the record tells what they are
    worth here. Every step counts, whoever's draft was verified: the target's tokens show how far
    the cache's draft would have gone (:class:`BesideCache` holds a draft that would go past them
    until later steps tell).

    >>> record = DraftRecord()
    >>> record.worth(3.0)  # nothing seen: as claimed
    3.0
    >>> for _ in range(10):
    ...     record.add(3.0, 7)  # long runs, claimed at 3
    >>> round(record.worth(3.0), 2), record.worth(0.5)  # 3 (70 + 8 * 3) / (30 + 8 * 3); another band
    (5.22, 0.5)
    """

    EDGES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
    PULL = 8.0

    def __init__(self) -> None:
        self.expected = np.zeros(len(self.EDGES) + 1)
        self.accepted = np.zeros(len(self.EDGES) + 1)

    def _band(self, expected: float) -> int:
        return int(np.searchsorted(self.EDGES, expected, side="right"))

    def add(self, expected: float, accepted: int) -> None:
        """A draft expected to have ``expected`` tokens accepted had ``accepted``."""
        b = self._band(expected)
        self.expected[b] += expected
        self.accepted[b] += accepted

    def worth(self, expected: float) -> float:
        """What a draft expected to have ``expected`` tokens accepted is worth, by this record."""
        b = self._band(expected)
        pull = self.PULL * expected
        if pull <= 0:
            return 0.0
        return expected * float((self.accepted[b] + pull) / (self.expected[b] + pull))


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


@dataclass
class ReadTimes:
    """What a model's reads take, each a moving average in seconds (``None`` until timed): a
    read of one token as a chain extends, a token of a step's first read (at most
    :data:`CATCH_UP` a row), and a token of a longer first read (a prompt). Where rows read in
    one forward, each is timed at its share of it. The models of one engine, copies of the same
    weights, share theirs (:class:`decoder_client.engines.beside.ModelRows`).
    """

    read: float | None = None
    catch_up: float | None = None
    prompt: float | None = None

    def restart(self) -> None:
        """Time a step's reads anew: what their averages held is stale (the model read nothing
        for long, :class:`decoder_client.engines.read_retry.ReadRetry`). A prompt's rate is kept,
        to be moved by the next prompt read."""
        self.read = self.catch_up = None


@dataclass(frozen=True)
class StepCosts:
    """What a step costs where the decoder knows it: seconds for the target to verify ``n``
    draft tokens, for the draft model to read one token as its chain extends, and, a token, to
    read the tokens a step produced that it has not read (its next step starts so)."""

    verify: Callable[[int], float]
    read: float
    catch_up: float = 0.0

    def chain_reads(self, n: int) -> float:
        """The model's reads for a chain of ``n`` it proposes: its ``n - 1`` reads past the first
        token and its read of the step's last token."""
        return max(0, n - 1) * self.read + self.catch_up

    def reads_after(self, produced: float) -> float:
        """The model's read, at its next step, of the ``produced`` tokens a step of the cache's
        draft gives."""
        return produced * self.catch_up


def model_goes(
    model: NextToken | None,
    cache_expected: float,
    k: int,
    *,
    cache_tokens: int = 0,
    at_least: float = 0.0,
    costs: StepCosts | None = None,
) -> bool:
    """Whether the model's chain of at most ``k`` is proposed: it has one, and the target is
    expected to accept at least as many of its tokens (by the model's track record, the tokens
    less likely than ``at_least`` to be reached dropped) as of the cache's draft
    (``cache_expected``: the sum of its nodes' chances, 0 where it has none). With ``costs``,
    tokens per second decide: the model's chain costs its verification, its ``n - 1`` reads
    past the first and a read of the step's last token; the cache's ``cache_tokens`` their
    verification and a read of every token the step produces, which the model has not read.
    The model's first read this step is paid either way.

    >>> model_goes(NextToken(5, 0.4), 0.3, 1), model_goes(NextToken(5, 0.2), 0.3, 1), model_goes(None, 0.0, 8)
    (True, False, False)
    >>> model_goes(NextToken(5, 0.2, chance=0.9), 0.3, 1)  # right far more often than it says
    True
    >>> sure = NextToken(5, 0.9, chance=0.9, onward=0.9)  # a chain of 8 expected to give 5.1
    >>> model_goes(sure, 4.5, 8), model_goes(sure, 4.5, 8, at_least=0.5)  # ... or 4.2 cut at 0.5
    (True, False)
    >>> costs = StepCosts(verify=lambda n: 1.0 + 0.05 * n, read=0.3)  # 8 verified: 1.4; 7 reads: 2.1
    >>> model_goes(sure, 4.5, 8, cache_tokens=6, costs=costs)  # 6.1 / 3.5 against 5.5 / 1.3
    False
    >>> behind = StepCosts(verify=costs.verify, read=0.3, catch_up=1.0)  # the model reads the cache's tokens after
    >>> model_goes(sure, 4.5, 8, cache_tokens=6, costs=behind)  # 6.1 / 4.5 against 5.5 / 6.8
    True
    """
    if model is None:
        return False
    reach = model.reaches(k)
    reach = reach[reach >= at_least]
    if reach.size == 0:
        return False
    if costs is None:
        return float(reach.sum()) >= cache_expected
    theirs = (1.0 + float(reach.sum())) / (costs.verify(reach.size) + costs.chain_reads(reach.size))
    return theirs >= _cache_rate(cache_expected, cache_tokens, costs)


def _cache_rate(cache_expected: float, cache_tokens: int, costs: StepCosts) -> float:
    """Tokens a second of a step that verifies the cache's draft, the model's reads after it included."""
    produced = 1.0 + cache_expected
    return produced / (costs.verify(cache_tokens) + costs.reads_after(produced))


def model_could_pay(cache_expected: float, cache_tokens: int, k: int, costs: StepCosts) -> bool:
    """Whether a model's chain of ``k`` could bring more tokens a second than the cache's draft
    even if every token of it were right. Where it could not, the model need not read the step's
    tokens at all (it reads them when it is next asked).

    >>> costs = StepCosts(verify=lambda n: 1.0 + 0.05 * n, read=0.3)  # a chain of 8: 3.5
    >>> model_could_pay(1.0, 2, 8, costs), model_could_pay(5.5, 6, 8, costs)  # 9 / 3.5: 2 / 1.1, 6.5 / 1.3
    (True, False)
    """
    best = (1.0 + k) / (costs.verify(k) + costs.chain_reads(k))
    return best > _cache_rate(cache_expected, cache_tokens, costs)


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
        self._chain: np.ndarray | None = None  # the chain extend() gave from that token
        self.record = ModelRecord()  # how often its first tokens were the target's, and how far its chains went
        self.forwards = 0  # forward passes, for what drafting cost
        self.fed = 0  # tokens those passes read
        self.times = ReadTimes()  # what its reads take

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

    @property
    def read_seconds(self) -> float | None:
        """A read of one token while a chain extends."""
        return self.times.read

    @property
    def catch_up_seconds(self) -> float | None:
        """A token of a step's first read, at most :data:`CATCH_UP` long."""
        return self.times.catch_up

    @property
    def prompt_seconds(self) -> float | None:
        """A token of a longer first read."""
        return self.times.prompt

    def unread(self, context: np.ndarray) -> int:
        """How many ids of ``context`` a read of it would feed the model: what its cache does
        not hold, and at least the last (read again for its logits).

        >>> class Held(ChainModel):
        ...     def _feed(self, ids): return np.ones(4) / 4
        ...     def _rewind(self, n): pass
        >>> m = Held(k=2, vocab_size=4, max_positions=None)
        >>> ids = np.array([1, 2, 3, 0, 1], np.int32)
        >>> m.unread(ids[:3]), m.first(ids[:3]).token
        (3, 0)
        >>> m.unread(ids), m.unread(ids[:2]), m.unread(ids[:3])
        (2, 1, 1)
        """
        n = int(np.asarray(context).size)
        return n - min(shared_prefix(self._held, np.asarray(context)), max(n - 1, 0))

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
        self._next = self._asked = self._chain = None

    def _start(self, context: np.ndarray) -> np.ndarray | None:
        """Check ``context``, rewind the cache to what it shares with it, and give the ids left
        to read (at least the last, for its logits); ``None`` where it does not fit."""
        ctx = as_tokens(context, self.vocab_size, what="context")
        if ctx.size == 0:
            raise ValueError("context must not be empty")
        self._next = None
        held = shared_prefix(self._held, ctx)
        if self._asked is not None:  # the target's tokens where the model's first one was, and its chain
            at, nxt = self._asked
            if ctx.size > at and held >= at:
                self.record.outcome(nxt.prob, nxt.token, self._chain, ctx[at:])
            self._asked = self._chain = None
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
    reads = [f for f in feeds if f is not None]
    out: list[NextToken | None] = [None] * len(models)
    start = time.perf_counter()
    probs = read_many([models[i] for i in fit], reads)
    seconds, fed = time.perf_counter() - start, sum(int(f.size) for f in reads)
    if fed:
        prompt = any(f.size > CATCH_UP for f in reads)  # a prompt's read, not only steps' tokens
        for times in _distinct(models[i].times for i in fit):
            if prompt:
                times.prompt = _averaged(times.prompt, seconds / fed)
            else:
                times.catch_up = _averaged(times.catch_up, seconds / fed)
    for i, p in zip(fit, probs, strict=True):
        token = int(np.argmax(p))
        m, prob = models[i], float(p[token])
        nxt = m.record.next_token(token, prob)
        m._next = out[i] = nxt
        m._asked = (int(m._held.size), nxt)
    return out


def extend_many(
    models: Sequence[ChainModel], min_prob: float = 0.0, most: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """:meth:`ChainModel.extend` for each model (distinct models), one read of all the chains
    still going per depth; with ``most``, chains of at most that many tokens."""
    tokens: list[list[int]] = []
    probs: list[list[float]] = []
    for m in models:
        if m._next is None:
            raise RuntimeError("no next token to extend: call first() with a context that fits")
        tokens.append([m._next.token])
        probs.append([m._next.prob])
    reach = [p[0] for p in probs]
    limit = [m.k if most is None else min(m.k, most) for m in models]
    going = [i for i in range(len(models)) if limit[i] > 1 and reach[i] >= min_prob]
    while going:
        start = time.perf_counter()
        read = read_many([models[i] for i in going], [np.array(tokens[i][-1:], dtype=np.int32) for i in going])
        seconds = (time.perf_counter() - start) / len(going)  # a row's share of a read of one token each
        for times in _distinct(models[i].times for i in going):
            times.read = _averaged(times.read, seconds)
        for i, p in zip(going, read, strict=True):
            m = models[i]
            m._held = np.append(m._held, np.int32(tokens[i][-1]))
            token = int(np.argmax(p))
            tokens[i].append(token)
            probs[i].append(float(p[token]))
            reach[i] *= probs[i][-1]
        going = [i for i in going if len(tokens[i]) < limit[i] and reach[i] >= min_prob]
    out = [(np.array(t, dtype=np.int32), np.array(p, dtype=np.float32)) for t, p in zip(tokens, probs, strict=True)]
    for m, (chain, _) in zip(models, out, strict=True):
        m._next = None
        m._chain = chain  # the next context tells how far it went
    return out


def _distinct(times: Iterable[ReadTimes]) -> list[ReadTimes]:
    """Each of ``times`` once: models that share theirs count a batch's read once."""
    return list({id(t): t for t in times}.values())


def _averaged(average: float | None, seconds: float) -> float:
    """A moving average of read times, ``seconds`` counted in."""
    return seconds if average is None else 0.9 * average + 0.1 * seconds


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
    model's chains. Each step proposes the model's chain unless more of the cache's draft is
    expected to be accepted (:func:`model_goes`), or, given ``verify_seconds`` (the target's step
    by the draft tokens it verifies), more of it a second, the model's reads timed as it drafts
    (and where even a chain right throughout could not pay, the model does not read the step);
    where the cache has nothing (it is empty there, or down and its client fell back), the
    model's chain goes. The cache is asked every step, so its session follows the request
    whichever draft is verified.

    >>> drafter = BesideCache(cache_drafter, ModelDrafter(small_model, k=8))  # doctest: +SKIP
    >>> tokens, stats = ReferenceDecoder(target).generate(ids, 128, drafter=drafter)  # doctest: +SKIP
    >>> drafter.model_steps / drafter.steps  # doctest: +SKIP
    0.64
    """

    def __init__(
        self,
        cache: Drafter,
        model: ChainSource,
        verify_seconds: Callable[[int], float] | None = None,
        record: DraftRecord | None = None,
    ) -> None:
        self.cache = cache
        self.model = model
        self.verify_seconds = verify_seconds  # the target's step by draft tokens verified, where known
        self.steps = 0
        self.model_steps = 0  # steps that proposed the model's chain
        self.skipped = 0  # steps the model did not read: its chain could not have paid
        self.accepted = {"model": 0, "cache": 0}  # accepted draft tokens by whose draft it was
        # what the cache's drafts were worth against their chances (one may serve many requests)
        self.record = record if record is not None else DraftRecord()
        self._last: tuple[DraftTree, str, int] | None = None  # the last draft, whose, at what length
        # the cache's drafts whose outcome the target's tokens have not shown yet: each, its claim, after what
        self._pending: list[tuple[DraftTree, float, np.ndarray]] = []

    def __call__(self, context: np.ndarray) -> DraftTree:
        self._count(context)
        ours = self.cache(context)
        self.steps += 1
        claimed = expected_accepted(ours)
        if len(ours):
            self._pending.append((ours, claimed, context.copy()))
        worth = self.record.worth(claimed)
        costs = None
        if self.verify_seconds is not None:
            costs = StepCosts(
                self.verify_seconds,
                getattr(self.model, "read_seconds", None) or 0.0,
                getattr(self.model, "catch_up_seconds", None) or 0.0,
            )
            if not model_could_pay(worth, len(ours), self.model.k, costs):
                self.skipped += 1
                return self._proposed(ours, "cache", context)
        nxt = self.model.first(context)
        if not model_goes(nxt, worth, self.model.k, cache_tokens=len(ours), costs=costs):
            return self._proposed(ours, "cache", context)
        tree = model_chain(*self.model.extend())
        if len(tree) == 0:  # the model gave no chain after all
            return self._proposed(ours, "cache", context)
        self.model_steps += 1
        return self._proposed(tree, "model", context)

    def _proposed(self, tree: DraftTree, whose: str, context: np.ndarray) -> DraftTree:
        """``tree``, remembered as this step's draft (``whose``) until the next context shows its outcome."""
        self._last = (tree, whose, int(context.size))
        return tree

    def _count(self, context: np.ndarray) -> None:
        """Credit the last draft with what the target accepted of it (all the new tokens but the
        last, the step's own); a context that did not grow from it is another request."""
        if self._last is not None:
            tree, whose, at = self._last
            if context.size > at:
                self.accepted[whose] += len(tree.accept(context[at:-1]))
        self._last = None
        still = []
        for ours, claimed, before in self._pending:  # how far the cache's drafts went, or would have
            at = before.size
            if context.size <= at or not np.array_equal(context[:at], before):
                continue  # another request
            truth = context[at:]
            path = ours.accept(truth)
            if len(path) == truth.size and bool(np.any(ours.parents == (path[-1] if path else -1))):
                still.append((ours, claimed, before))  # it would go past what is known yet
            else:
                self.record.add(claimed, len(path))
        self._pending = still

    def observe_topk(self, verified: object) -> None:
        """Passed on to the cache's drafter, if it takes the target's top-k."""
        observe = getattr(self.cache, "observe_topk", None)
        if observe is not None:
            observe(verified)

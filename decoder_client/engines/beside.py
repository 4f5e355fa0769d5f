"""A draft model's chain in an engine's proposal, beside the cache's (the rule of
:mod:`decoder_client.chain_model`), and the per-request draft models of an engine that batches.

:func:`beside` is the step's choice, as every engine adapter makes it: the model's chain where
more of it is expected to be accepted than of the cache's, cut where a token is less likely than
the engine's cut to be reached, as the cache's chains are. Its tokens carry no claims: the model's
probabilities are its own, and the outcomes that correct the cache's claims
(:class:`~decoder_client.engines.outcomes.ChainOutcomes`) must not learn from them.

Once the engine's steps are timed (:class:`~decoder_client.engines.step_cost.StepCost`),
each draft is weighed net of what it costs, in tokens' worth as the engine's cut weighs them
(seconds over the time a produced token takes): the cache's, its verification and the model's
later read of every token the step produces; the model's, its verification and its reads as its
chain extends (:class:`ReadPrices`). Where even a chain of the model's right throughout could not
beat the cache's draft, the model reads nothing that step: it catches up when next asked (a
model priced out for long has its reads timed again now and then:
:class:`~decoder_client.engines.read_retry.ReadRetry`). A
prompt is a read of its own (:func:`plan_read`): it waits for the engine's first steps to be
timed, and is read only where the chains pay for that read too, a share of it on each step the
request is expected to run, by the lengths of the engine's requests that ended
(:class:`~decoder_client.engines.request_steps.RequestSteps`). A draft model as slow as its
target then costs the engine the steps it pays for and a retry's reads, ever further apart. The
proposer's time in the model's reads is its own, not the engine's: the adapters take it out of
the step they record (:meth:`ModelRows.spent`), or the cut would charge it to every proposed
token.

:class:`ModelRows` keeps one :class:`~decoder_client.chain_model.ChainModel` per request of a
batch: each holds its own KV cache along its request, so a step reads only the request's new
tokens, and :meth:`ModelRows.beside` reads the whole batch's together (one forward per depth
where the model's class can share one, as :mod:`decoder_client.draft_model`'s does). A cache
is memory (for a 135M model in float32, about 46 KB a token), so at most ``limit`` requests
draft beside the model at once; the others draft from the cache alone until one of those ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from decoder_client.chain_model import (
    CATCH_UP,
    ChainModel,
    ChainSource,
    NextToken,
    ReadTimes,
    StepCosts,
    expected_tokens,
    extend_many,
    first_many,
    model_goes,
)
from decoder_client.engines.read_retry import ReadRetry
from decoder_client.engines.request_steps import RequestSteps
from decoder_client.engines.step_cost import StepCost, cut


class Proposal(NamedTuple):
    """One request's chain this step: its tokens, the cache's claims for them (empty for the
    model's), each token's chance of being reached, whether it is the model's, whether the
    model read nothing for it (its chain could not have paid, or its prompt waited), whether
    that was a prompt waiting for its price, and whether the model's reads were timed again
    this step (:class:`~decoder_client.engines.read_retry.ReadRetry`)."""

    chain: np.ndarray
    claims: np.ndarray
    scores: np.ndarray
    model: bool
    unread: bool = False
    waited: bool = False
    retried: bool = False


class ReadPlan(NamedTuple):
    """Whether a model reads a request's context this step, at what prices
    (:meth:`ReadPrices.of`), whether the read is a prompt's that times the model's rate for
    prompts, and, where it does not read, whether its prompt waits for a price."""

    reads: bool
    prices: ReadPrices | None
    probe: bool = False
    waits: bool = False


def beside(
    model: ChainSource,
    context: np.ndarray,
    chain: np.ndarray,
    claims: np.ndarray,
    scores: np.ndarray,
    max_len: int,
    min_prob: float,
    cost: StepCost | None = None,
    serves: float = 1.0,
    retry: ReadRetry | None = None,
) -> Proposal:
    """The cache's chain (``chain``, ``claims``, ``scores``, as
    :func:`~decoder_client.engines.step_cost.chain_to_propose` gives them) or the model's after
    ``context``, whichever is expected to have more tokens accepted (once ``cost`` has timed the
    engine's steps, net of what each costs); the model's is at most ``max_len`` tokens, cut at
    ``min_prob`` (its tokens by the model's record). The model reads ``context`` unless its chain
    could not pay (its cache follows the request); a prompt's read is charged to the ``serves``
    steps the request is expected to run (:func:`plan_read`). With ``retry``, a model priced out
    for long enough has its reads timed again (:func:`time_reads`, on the model itself, which
    then reads the whole context if it reads), and the rule is asked again on those times
    (:class:`~decoder_client.engines.read_retry.ReadRetry`).

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
    >>> cost = StepCost(prior=0.3)
    >>> for i in range(64):  # the engine's steps measured: 20 ms, and 2 ms a proposed token
    ...     cost.record(0.020 + 0.002 * (i % 5), i % 5, rows=1, produced=1)
    >>> class Slow(Sure):  # as sure, but a read of one token takes as long as the target's step
    ...     read_seconds, catch_up_seconds = 0.024, 0.008
    ...     def first(self, context): raise AssertionError("read")
    >>> good = np.array([3, 4, 5]), np.zeros(3), np.array([0.9, 0.6, 0.5])  # 2.0 expected
    >>> p = beside(Slow(), np.array([1, 2]), *good, max_len=4, min_prob=0.1, cost=cost)
    >>> p.model, p.unread  # the cache's, the model not even read
    (False, True)
    >>> beside(Sure(), np.array([1, 2]), *good, max_len=4, min_prob=0.1, cost=cost).model  # reads for free
    True
    """
    ours = Proposal(chain, claims, scores, False)
    plan = plan_read(model, context, ours, max_len, cost, serves=serves)
    retried = False
    if retry is not None and isinstance(model, ChainModel) and not plan.reads and not plan.waits and retry.due():
        retry.retried()
        time_reads([model], [context])  # what it held is forgotten: its next read is the whole context
        plan, retried = plan_read(model, context, ours, max_len, cost, serves=serves), True
    if retry is not None and not plan.waits:
        retry.after(read=plan.reads)
    if not plan.reads:
        return ours._replace(unread=True, waited=plan.waits, retried=retried)
    ours = ours._replace(retried=retried)
    if not _model_goes(model.first(context), ours, max_len, min_prob, plan.prices):
        return ours
    return _model_proposal(ours, *model.extend(min_prob), max_len, min_prob)._replace(retried=retried)


TIMING_READS = 3  # a retry's reads of one token as a chain extends (a chain of 4)


def time_reads(models: Sequence[ChainModel], contexts: Sequence[np.ndarray]) -> None:
    """Time a step's reads anew (:meth:`~decoder_client.chain_model.ReadTimes.restart`): each of
    ``models`` reads the last two tokens of its context, as a step's catch-up, and extends a
    chain from them by :data:`TIMING_READS` reads, all in one forward per depth, then forgets
    them. Nothing they give is proposed; a model holds nothing after."""
    for m in models:
        m.times.restart()
        m.reset()
    nexts = first_many(models, [c[-2:] for c in contexts])
    extend_many([m for m, nxt in zip(models, nexts, strict=True) if nxt is not None], most=TIMING_READS + 1)
    for m in models:
        m.reset()


class ReadPrices(NamedTuple):
    """A draft's worth net of its cost, in tokens' worth: what it is expected to bring, less its
    seconds (:class:`~decoder_client.chain_model.StepCosts`, the reference decoder's accounting:
    the engine's verification of its tokens past a step with none, by its measured ``cost``, and
    the model's reads) over the time a produced token takes (:attr:`StepCost.token_s`).

    >>> cost = StepCost(prior=0.3)
    >>> for i in range(64):  # 20 ms a step, 2 ms per proposed token, one token a step
    ...     cost.record(0.020 + 0.002 * (i % 5), i % 5, rows=1, produced=1)
    >>> slow = ReadPrices.at(cost, read=0.024, catch_up=0.012)  # a model as slow as the target's step
    >>> round(slow.cache(0.8, 2), 2)  # 0.8 expected less 2 tokens' 0.17 and 1.8 tokens read, 0.9
    -0.27
    >>> round(slow.model(np.full(8, 0.9)), 2)  # 7.2 less 8 tokens' 0.67 and 7.5 tokens' worth of reads
    -0.99
    >>> ours = Proposal(np.arange(3), np.zeros(3), np.array([0.9, 0.6, 0.5]), False)  # 2.0 expected
    >>> slow.could_pay(ours, 8)  # 2.0 less 0.25 and 1.5 against 8 less 0.67 and 7.5
    False
    >>> ReadPrices.at(cost, read=0.002, catch_up=0.001).could_pay(ours, 8)  # a model a tenth as dear
    True
    """

    costs: StepCosts
    token_s: float
    prompt: float | None = None  # a token of the model's read of a prompt (None: not yet timed)

    @classmethod
    def at(cls, cost: StepCost, read: float, catch_up: float, prompt: float | None = None) -> ReadPrices:
        """Prices by the engine's ``cost`` for a model whose read of one token as its chain
        extends takes ``read`` seconds, a token of its first read of a step ``catch_up``
        (the tokens the last step produced, which it has not read), and a token of a prompt
        ``prompt``."""

        def verify(n: int) -> float:  # a step's time with n proposed, less its time with none
            return float(cost.costs(n)[n]) * cost.token_s

        return cls(StepCosts(verify, read, catch_up), cost.token_s, prompt)

    @classmethod
    def of(cls, model: ChainSource, cost: StepCost | None) -> ReadPrices | None:
        """The prices for ``model`` once ``cost`` knows what a produced token takes (its first
        steps; verification at the configured prior until the line is measured); ``None`` before,
        and where the cost is configured rather than measured (the rule then weighs expected
        tokens alone). A model not yet timed extending a chain is priced at a token of its first
        read, and that, not yet timed, at a token of a prompt (a read of one token costs at
        least either)."""
        if cost is None or cost.token_s <= 0:
            return None
        prompt = getattr(model, "prompt_seconds", None)
        catch_up = getattr(model, "catch_up_seconds", None) or prompt or 0.0
        read = getattr(model, "read_seconds", None) or catch_up
        return cls.at(cost, read, catch_up, prompt)

    def _net(self, expected: float, n: int, reads: float) -> float:
        return expected - (self.costs.verify(n) + reads) / self.token_s

    def cache(self, expected: float, n: int) -> float:
        """The cache's draft of ``n`` tokens, ``expected`` of them accepted: its verification,
        and the model's read of what the step produces."""
        return self._net(expected, n, self.costs.reads_after(1.0 + expected))

    def model(self, reaches: np.ndarray) -> float:
        """The model's chain, each token's chance of being reached: its verification, its reads
        past the first token and its read of the step's last token."""
        n = int(reaches.size)
        return self._net(float(reaches.sum()), n, self.costs.chain_reads(n))

    def prompt_read(self, unread: int) -> float:
        """Seconds of the model's first read of ``unread`` tokens that no earlier draft was
        charged for: a prompt's (more than :data:`~decoder_client.chain_model.CATCH_UP`), at the
        model's rate for prompts (none until timed). A step's catch-up was charged to the drafts
        whose steps produced its tokens."""
        return unread * (self.prompt or 0.0) if unread > CATCH_UP else 0.0

    def could_pay(self, ours: Proposal, max_len: int, unread: int = 0, serves: float = 1.0) -> bool:
        """Whether the model's chain of ``max_len``, were it right throughout, would be worth
        more than the cache's draft ``ours``, the model's read of its ``unread`` tokens first.
        A prompt's read serves the request's later steps too: it is charged to each of the
        ``serves`` steps the request is expected to run from this one
        (:class:`~decoder_client.engines.request_steps.RequestSteps`), each worth as much.

        >>> cost = StepCost(prior=0.3)
        >>> for i in range(64):  # 20 ms a step, 2 ms per proposed token, one token a step
        ...     cost.record(0.020 + 0.002 * (i % 5), i % 5, rows=1, produced=1)
        >>> prices = ReadPrices.at(cost, read=0.002, catch_up=0.001, prompt=0.001)  # a model a tenth as dear
        >>> ours = Proposal(np.arange(3), np.zeros(3), np.array([0.9, 0.6, 0.5]), False)
        >>> prices.could_pay(ours, 8, unread=400)  # 400 ms of prompt: 17 tokens' worth, in one step
        False
        >>> prices.could_pay(ours, 8, unread=400, serves=20)  # ... or less than one a step over 20
        True
        """
        mine = self.model(np.ones(max_len)) - self.prompt_read(unread) / (self.token_s * max(serves, 1.0))
        return mine > self.cache(expected_tokens(ours.scores), int(ours.chain.size))


def plan_read(
    model: ChainSource,
    context: np.ndarray,
    ours: Proposal,
    max_len: int,
    cost: StepCost | None,
    may_probe: bool = True,
    serves: float = 1.0,
) -> ReadPlan:
    """Whether ``model`` reads ``context`` this step, beside the cache's draft ``ours``.

    - A step's catch-up is read unless a chain of ``max_len`` right throughout could not pay.
    - A prompt (more than :data:`~decoder_client.chain_model.CATCH_UP` tokens unread) waits
      while ``cost`` is timing the engine's first steps; once they are, the chains of the
      ``serves`` steps the request is expected to run pay for its read too. The first read of
      a prompt, which times the rate, is priced as a catch-up; while it is untimed, a read that
      would be a second (``may_probe`` false) waits.
    - Where ``cost`` is configured rather than timed, or absent, the model reads every step.

    >>> from decoder_client.chain_model import NextToken
    >>> class Model:  # a read of one token takes a quarter of the engine's step, of a prompt's a tenth
    ...     k, vocab_size, read_seconds, catch_up_seconds, prompt_seconds = 8, 16, 0.005, 0.01, 0.002
    ...     def unread(self, context): return context.size
    >>> cost = StepCost(prior=0.3)
    >>> ours = Proposal(np.zeros(0), np.zeros(0), np.zeros(0), False)  # the cache has nothing
    >>> plan_read(Model(), np.arange(4), ours, 8, cost).reads, plan_read(Model(), np.arange(64), ours, 8, cost)
    (True, ReadPlan(reads=False, prices=None, probe=False, waits=True))
    >>> for i in range(8):  # the engine's first steps: 20 ms a token
    ...     cost.record(0.020, 0, rows=1, produced=1)
    >>> plan_read(Model(), np.arange(4), ours, 8, cost).reads  # 8 tokens less 2.4 verified, 2.25 read: 3.35 > -0.5
    True
    >>> plan_read(Model(), np.arange(64), ours, 8, cost).reads  # ... less a 64-token prompt's 6.4
    False
    >>> plan_read(Model(), np.arange(64), ours, 8, cost, serves=4).reads  # ... or its 1.6 a step over 4
    True
    >>> class Untimed(Model):
    ...     prompt_seconds = None
    >>> first = plan_read(Untimed(), np.arange(64), ours, 8, cost)
    >>> second = plan_read(Untimed(), np.arange(64), ours, 8, cost, may_probe=False)
    >>> first.reads, first.probe, second.reads, second.waits  # one read times the rate, another waits
    (True, True, False, True)
    """
    prices = ReadPrices.of(model, cost)
    unread = _unread(model, context)
    if unread <= CATCH_UP:
        return ReadPlan(prices is None or prices.could_pay(ours, max_len), prices)
    if prices is None:
        timing = cost is not None and cost.measure
        return ReadPlan(not timing, None, waits=timing)
    if prices.prompt is None:
        if not may_probe:
            return ReadPlan(False, prices, waits=True)
        return ReadPlan(prices.could_pay(ours, max_len), prices, probe=True)
    return ReadPlan(prices.could_pay(ours, max_len, unread, serves), prices)


def _unread(model: ChainSource, context: np.ndarray) -> int:
    """What ``model`` would read of ``context``: one token where it cannot tell."""
    unread = getattr(model, "unread", None)
    return 1 if unread is None else int(unread(context))


def _model_goes(
    nxt: NextToken | None, ours: Proposal, max_len: int, min_prob: float, prices: ReadPrices | None = None
) -> bool:
    """The rule for one request: the model's chain of at most ``max_len``, cut at ``min_prob``,
    against the cache's chain (each token's chance of being reached adds to what is expected);
    with ``prices``, each net of its cost."""
    expected = expected_tokens(ours.scores)
    if prices is None:
        return model_goes(nxt, expected, max_len, at_least=min_prob)
    if nxt is None:
        return False
    reach = nxt.reaches(max_len)
    reach = reach[reach >= min_prob]
    return bool(reach.size) and prices.model(reach) >= prices.cache(expected, int(ours.chain.size))


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
        self.skipped = 0  # rows held a model but did not read: its chain could not have paid
        self.waited = 0  # ... or its prompt waited for a price
        self.retried = 0  # rows priced out whose reads were timed again, and the rule asked again
        self.retry = ReadRetry()  # when a model priced out has its reads timed again
        self._scratch: list[ChainModel] = []  # models that time the reads for a retry, holding no request
        self.times = ReadTimes()  # what the models' reads take: copies of one model's weights, timed together
        self.steps = RequestSteps()  # how long the engine's requests run: what a prompt's read serves
        self._ages: dict[Hashable, int] = {}  # the steps each running request has drafted
        self._seconds = 0.0  # the models' reads since spent() last took them

    def beside(
        self,
        requests: Sequence[Hashable],
        contexts: Sequence[np.ndarray],
        ours: Sequence[Proposal],
        max_lens: Sequence[int],
        min_prob: float,
        cost: StepCost | None = None,
    ) -> list[Proposal]:
        """:func:`beside` for a batch: each request's proposal (``ours``: the cache's chain,
        claims and chances), the model's chain where it holds a model and more of its chain is
        expected to be accepted (net of its cost, once ``cost`` has timed the steps). The models read
        every context and chain of the batch together, but for the rows whose chain could not
        pay. A row's reads are priced at its share of the batch's (the models' times are kept
        so), as a produced token's time is its share of the engine's step; a prompt's read at its
        share of each step the request is expected to run yet (:attr:`steps`). Where every row
        has been priced out for long enough, the step's reads are timed again at this batch, on
        models of their own (:func:`time_reads`; the rows' models keep what they hold), and the
        rule asked again (:attr:`retry`)."""
        start = time.perf_counter()
        held: list[tuple[int, ChainModel, ReadPrices | None]] = []
        priced_out: list[tuple[int, ChainModel, float]] = []
        probe = True  # a prompt's read may time the models' rate for prompts, one a batch

        def plan(i: int, m: ChainModel, serves: float) -> None:
            nonlocal probe
            p = plan_read(m, contexts[i], ours[i], max_lens[i], cost, probe, serves)
            if p.waits:
                self.waited += 1
            elif not p.reads:
                priced_out.append((i, m, serves))
            else:
                probe = probe and not p.probe
                held.append((i, m, p.prices))

        for i, r in enumerate(requests):
            age = self._ages.get(r, 0)
            self._ages[r] = age + 1
            if (m := self.get(r)) is not None:
                plan(i, m, self.steps.remaining(age))
        if not held and priced_out and self.retry.due():
            self.retry.retried()
            self.retried += len(priced_out)
            time_reads(self._scratch_models(len(priced_out)), [contexts[i] for i, _, _ in priced_out])
            again, priced_out = priced_out, []
            for row in again:
                plan(*row)
        self.skipped += len(priced_out)
        if held or priced_out:
            self.retry.after(read=bool(held))
        nexts = first_many([m for _, m, _ in held], [contexts[i] for i, _, _ in held])
        self.reads += 1 if held else 0
        going = [
            (i, m)
            for (i, m, prices), nxt in zip(held, nexts, strict=True)
            if _model_goes(nxt, ours[i], max_lens[i], min_prob, prices)
        ]
        chains = extend_many([m for _, m in going], min_prob)
        self.reads += max((t.size - 1 for t, _ in chains), default=0)
        self._seconds += time.perf_counter() - start
        out = list(ours)
        for (i, _), (tokens, probs) in zip(going, chains, strict=True):
            out[i] = _model_proposal(ours[i], tokens, probs, max_lens[i], min_prob)
        return out

    def _scratch_models(self, n: int) -> list[ChainModel]:
        """``n`` models that hold no request, to time reads with (made as the rows' are, the
        weights shared, their times the rows')."""
        while len(self._scratch) < n:
            model = self._make()
            model.times = self.times
            self._scratch.append(model)
        return self._scratch[:n]

    def spent(self) -> float:
        """Seconds the models read for since the last call of this: the proposer's time in a
        step, which the engine's step cost must not count."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

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
            model.times = self.times
            self._made.append(model)
        else:
            return None
        self._held[request] = model
        return model

    def release(self, requests: Iterable[Hashable]) -> None:
        """These requests ended: their models forget them and are free for others, and their
        steps count to how long the engine's requests run."""
        for request in requests:
            self.steps.ended(self._ages.pop(request, 0))
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
        return sum(m.forwards for m in [*self._made, *self._scratch])

    @property
    def fed(self) -> int:
        """Tokens those passes read."""
        return sum(m.fed for m in [*self._made, *self._scratch])

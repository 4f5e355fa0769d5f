"""What a draft model beside the cache reads, as the beside rule prices it in an engine.

- A read of a prompt serves every later step of its request: an engine's models read a long
  prompt where the chains of the steps its requests run would repay it, though one step's chain
  would not, and the lengths they go by are the engine's own finished requests.
- A model priced out has its reads timed again, after twice as many priced-out steps each
  time: one that stays dear costs a step's reads now and then, and one whose reads got cheaper
  is found so."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

from decoder_client.chain_model import ChainModel
from decoder_client.engines.beside import TIMING_READS, ModelRows, Proposal, beside
from decoder_client.engines.read_retry import ReadRetry
from decoder_client.engines.request_steps import RequestSteps
from decoder_client.engines.step_cost import StepCost

VOCAB = 16
K = 4
PROMPT = 400
STEPS = 24  # what each request runs
FORWARD_S, TOKEN_S = 0.002, 0.0005  # a forward's fixed time, and a token's it reads


class Timed(ChainModel):
    """A model whose forwards take :attr:`forward_s` (:data:`FORWARD_S` unless set) and
    :data:`TOKEN_S` a token they read: a 400-token prompt 0.2 s, a token of a chain 2.5 ms."""

    forward_s = FORWARD_S

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        return self._feed_many([self], [ids])[0]

    @classmethod
    def _feed_many(cls, models: Sequence[ChainModel], feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        time.sleep(cls.forward_s + TOKEN_S * sum(f.size for f in feeds))
        return [np.eye(VOCAB)[(int(ids[-1]) + 1) % VOCAB] for ids in feeds]  # sure of the next token

    def _rewind(self, n: int) -> None:
        pass


def _engine() -> StepCost:
    """An engine measured at 10 ms a step, a token a step, and 1 ms more a proposed token: the
    model's chain of 4 right throughout is worth about 2.5 tokens a step more than the cache's
    nothing, and a prompt's read 0.2 s, 20 tokens' worth."""
    cost = StepCost(prior=0.3)
    for i in range(64):
        cost.record(0.010 + 0.001 * (i % 5), i % 5, rows=1, produced=1)
    return cost


def _run(rows: ModelRows, request: str, start: int, cost: StepCost) -> tuple[int, int]:
    """``request``: a prompt of :data:`PROMPT` tokens, then a token a step for :data:`STEPS`
    steps, the cache drafting nothing; the tokens the models read in its first step, and in all."""
    nothing = Proposal(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), False)
    context = ((np.arange(PROMPT) + start) % VOCAB).astype(np.int32)
    fed = rows.fed
    first = 0
    for _ in range(STEPS):
        rows.beside([request], [context], [nothing], [K], 0.0, cost)
        first = first or rows.fed - fed
        context = np.append(context, np.int32((context[-1] + 1) % VOCAB))
    rows.release([request])
    return first, rows.fed - fed


def test_a_prompt_is_read_where_the_steps_it_serves_repay_it() -> None:
    cost = _engine()
    rows = ModelRows(lambda: Timed(k=K, vocab_size=VOCAB, max_positions=None), limit=2)
    # The first prompt times the models' rate for prompts (read as a catch-up is priced), and
    # its steps are the first request's length the engine knows.
    first, _ = _run(rows, "a", 0, cost)
    assert first >= PROMPT and rows.steps.count == 1 and rows.steps.remaining(0) == STEPS
    assert rows.times.prompt is not None
    # A request whose prompt is charged to the one step reading it does not read: 20 tokens'
    # worth against the chain's 2.5. Nor does it later: its backlog only grows.
    alone = ModelRows(lambda: Timed(k=K, vocab_size=VOCAB, max_positions=None), limit=2)
    alone.times = rows.times
    first, fed = _run(alone, "b", 3, cost)
    assert first == fed == 0 and alone.skipped == STEPS
    # The engine that has seen a request run 24 steps charges each of them a 24th: read.
    skipped = rows.skipped
    first, fed = _run(rows, "c", 5, cost)
    assert first >= PROMPT and fed >= PROMPT + STEPS - 1 and rows.skipped == skipped
    assert rows.steps.count == 2


def test_a_request_past_the_longest_the_engine_has_seen_is_charged_its_backlog_in_one_step() -> None:
    steps = RequestSteps(keep=2)
    for n in (5, 50, 20):  # the ring keeps the last two
        steps.ended(n)
    steps.ended(0)  # a request that drafted no step
    assert steps.count == 3
    assert steps.remaining(0) == 35.0 and steps.remaining(19) == 16.0 and steps.remaining(50) == 1.0


def _short(start: int) -> np.ndarray:
    return ((np.arange(8) + start) % VOCAB).astype(np.int32)


@pytest.mark.parametrize("rows_of", ["batch", "single"])
def test_a_model_priced_out_is_read_again_and_found_cheaper(rows_of: str) -> None:
    # Two requests of short prompts (a step's catch-up each) beside a model whose forwards take
    # 40 ms: a chain of 4 reads 160 ms, 16 tokens' worth where a step's token takes 10 ms.
    cost = _engine()
    nothing = Proposal(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), False)

    class Model(Timed):
        forward_s = 0.04

    retry = ReadRetry(first=4, most=64)
    rows = ModelRows(lambda: Model(k=K, vocab_size=VOCAB, max_positions=None), limit=2)
    rows.retry = retry
    alone = Model(k=K, vocab_size=VOCAB, max_positions=None)  # llama.cpp's one request, beside()
    contexts = [_short(0), _short(5)]

    def step() -> tuple[bool, list[Proposal]]:
        """A step: whether the model read, and the proposals."""
        nonlocal contexts
        fed = rows.fed + alone.fed
        if rows_of == "batch":
            out = rows.beside(["a", "b"], contexts, [nothing, nothing], [K, K], 0.0, cost)
        else:
            out = [beside(alone, contexts[0], *nothing[:3], K, 0.0, cost, retry=retry)]
        contexts = [np.append(c, np.int32((c[-1] + 1) % VOCAB)) for c in contexts]
        return rows.fed + alone.fed > fed, out

    times = rows.times if rows_of == "batch" else alone.times
    read, out = step()
    assert read and out[0].model  # its first read is not yet priced, and its chain goes
    dear = [step() for _ in range(15)]
    # Priced out from the second step; its reads timed again after 4 steps priced out, then 8.
    assert retry.count == 2 and retry.patience == 16
    assert [i for i, (read, _) in enumerate(dear) if read] == [4, 12]
    assert not any(p.model for _, out in dear for p in out)
    assert times.read is not None and times.read > 0.015  # 40 ms a forward, a row's share at the batch
    # The model's forwards get cheap (a millisecond): the next retry, after 16 priced-out
    # steps, times its reads anew, and from then on it reads every step and its chains go.
    Model.forward_s = 0.001
    cheap = [step() for _ in range(24)]
    assert [i for i, (read, _) in enumerate(cheap) if read] == list(range(13, 24))
    assert retry.count == 3 and retry.patience == 4
    assert times.read is not None and times.read < 0.01
    assert all(p.model for _, out in cheap[14:] for p in out)
    if rows_of == "batch":  # both rows timed in each retry, and priced out but in the last
        assert rows.retried == 6 and rows.skipped == 2 * (15 + 13)
        # The reads were timed on models of their own: the rows' models kept what they held
        # (their first 9 tokens) and read what came after as a step's catch-up. Had they
        # forgotten it, each would have had a prompt to read, whose rate no read has timed:
        # one would have read and timed it, the other waited.
        assert rows.waited == 0


def test_a_retry_times_a_few_reads_however_long_the_chains() -> None:
    # Chains of 16 beside a model whose forwards take 40 ms: priced out after its first step.
    # A retry's reads are a step's catch-up and a few of a chain's: not a chain of 16 a row.
    cost = _engine()
    nothing = Proposal(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), False)

    class Model(Timed):
        forward_s = 0.04

    rows = ModelRows(lambda: Model(k=16, vocab_size=VOCAB, max_positions=None), limit=2)
    rows.retry = ReadRetry(first=1, most=8)
    contexts = [_short(0), _short(5)]
    forwards = []
    for _ in range(3):
        before = rows.forwards
        rows.beside(["a", "b"], contexts, [nothing, nothing], [16, 16], 0.0, cost)
        forwards.append(rows.forwards - before)
        contexts = [np.append(c, np.int32((c[-1] + 1) % VOCAB)) for c in contexts]
    assert forwards == [2 * 16, 0, 2 * (1 + TIMING_READS)] and rows.retried == 2 and rows.skipped == 4

"""Drafters over one model read together: one forward per depth for a batch of requests, and
every request's chain exactly what the model's own greedy generation gives after its context,
as contexts grow, are cut back, start over and arrive with long prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.draft_model_bench import DraftModelBenchConfig, run_draft_model_bench
from decoder_client.chain_model import extend_many, first_many
from decoder_client.draft_model import ALONE_FROM, RESTACK_AFTER, ModelDrafter, _Stack
from tests.client.conftest import greedy_continuation
from tests.client.test_draft_model import VOCAB, _ids, _llama

K = 6


def _forwards(model: torch.nn.Module) -> list[int]:
    """Counts the model's forward passes (its batch size each)."""
    calls: list[int] = []
    model.register_forward_hook(
        lambda _m, _args, kwargs, _out: calls.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True
    )
    return calls


def test_a_batch_reads_together_and_each_row_gets_its_own_greedy_chain() -> None:
    model = _llama(0)
    calls = _forwards(model)
    rows = [ModelDrafter(model, K) for _ in range(4)]
    rng = np.random.default_rng(3)
    contexts = [_ids(rng.integers(0, VOCAB, n)) for n in (5, 12, 3, 40)]  # the last is a long prompt
    for step in range(12):
        calls.clear()
        firsts = first_many(rows, contexts)
        assert all(f is not None for f in firsts)
        chains = extend_many(rows, 0.0)
        seen = list(calls)
        if step == 0:  # the long prompt alone, the three short ones together; then the chains
            assert seen == [1, 3] + [4] * (K - 1)
        else:  # every read this step is short: one forward per depth for all four
            assert seen == [4] * K, step
        for r, (ctx, (tokens, probs)) in enumerate(zip(contexts, chains, strict=True)):
            assert tokens.tolist() == greedy_continuation(model, ctx.tolist(), K), (step, r)
            assert probs.dtype == np.float32 and np.all((probs > 0) & (probs <= 1))
        for r, (tokens, _) in enumerate(chains):
            move = (step + r) % 4
            if move == 0:  # part of the chain accepted, then the bonus
                contexts[r] = _ids([*contexts[r], *tokens[: 1 + r], int(rng.integers(0, VOCAB))])
            elif move == 1:  # nothing accepted
                contexts[r] = _ids([*contexts[r], int(rng.integers(0, VOCAB))])
            elif move == 2:  # cut back below what the cache holds
                contexts[r] = contexts[r][: max(2, contexts[r].size - 3)]
            else:  # the whole chain and the bonus
                contexts[r] = _ids([*contexts[r], *tokens, int(rng.integers(0, VOCAB))])


def test_rows_of_one_batch_stop_at_their_own_cut_and_a_new_request_starts_clean() -> None:
    model = _llama(1)
    rows = [ModelDrafter(model, 8) for _ in range(3)]
    contexts = [_ids(range(10, 20)), _ids(range(30, 45)), _ids(range(50, 53))]
    first_many(rows, contexts)
    whole = extend_many(rows, 0.0)
    reach = [np.cumprod(p.astype(np.float64)) for _, p in whole]
    # Row 0's third token falls below the cut; the others' by their own chances. The cut sits
    # midway: rows read in another layout differ in their last bits.
    cut = float(reach[0][1] + reach[0][2]) / 2
    assert reach[0][2] < 0.99 * reach[0][1]
    first_many(rows, contexts)
    short = extend_many(rows, cut)
    for (tokens, probs), (t_all, p_all), r in zip(short, whole, reach, strict=True):
        below = np.flatnonzero(r < cut)
        n = int(below[0]) + 1 if below.size else t_all.size
        assert tokens.tolist() == t_all[:n].tolist()
        assert np.allclose(probs, p_all[:n], atol=1e-5)
    rows[1].reset()  # its request ended; another arrives on the same drafter
    fresh = _ids(range(90, 100))
    first_many(rows, [contexts[0], fresh, contexts[2]])
    tokens = extend_many(rows, 0.0)[1][0]
    assert tokens.tolist() == greedy_continuation(model, fresh.tolist(), 8)


def test_a_stack_lasts_while_its_rows_read_on_and_its_entries_go_back_when_needed() -> None:
    model = _llama(3)
    rows = [ModelDrafter(model, K) for _ in range(3)]
    contexts = [_ids(range(10, 14)), _ids(range(20, 29)), _ids(range(40, 46))]
    stacks: list[object] = []
    for step in range(10):
        first_many(rows, contexts)
        stacks.append(rows[0]._stack)
        chains = extend_many(rows, 0.0)
        stacks.append(rows[0]._stack)
        assert stacks[-1] is not None and all(r._stack is stacks[-1] for r in rows)
        for r, (ctx, (tokens, _)) in enumerate(zip(contexts, chains, strict=True)):
            assert tokens.tolist() == greedy_continuation(model, ctx.tolist(), K), (step, r)
        # Every chain taken whole: nothing rewinds, so the next step reads in the same stack.
        contexts = [
            _ids([*c, *t, (step * 7 + r) % VOCAB]) for r, (c, (t, _)) in enumerate(zip(contexts, chains, strict=True))
        ]
    # Stacks last across steps, and are built again only once they have grown RESTACK_AFTER.
    changes = [i for i in range(1, len(stacks)) if stacks[i] is not stacks[i - 1]]
    assert 1 <= len(changes) <= 5  # of 19 chances
    for i in changes:
        old = stacks[i - 1]
        assert isinstance(old, _Stack) and old.valid.shape[1] - old.built >= RESTACK_AFTER
    # Until something needs it, a row's own cache lags; asking for it brings every row's back.
    held = [r._held.size for r in rows]
    assert rows[1]._own.get_seq_length() < held[1]
    assert rows[1]._cache.get_seq_length() == held[1]
    assert all(r._stack is None and r._own.get_seq_length() == h for r, h in zip(rows, held, strict=True))
    for row, ctx in zip(rows, contexts, strict=True):  # and each reads on alone from it
        assert row.chain(ctx).tolist() == greedy_continuation(model, ctx.tolist(), K)


def test_rows_going_on_read_in_their_stack_while_at_most_one_would_pad() -> None:
    model = _llama(4)
    rows = [ModelDrafter(model, 4) for _ in range(4)]
    contexts = [_ids(range(10 + 10 * r, 16 + 10 * r)) for r in range(4)]
    first_many(rows, contexts)
    stack = rows[0]._stack
    going = extend_many(rows[:3], 0.0)  # three of four go on: the fourth reads pads
    assert all(r._stack is stack for r in rows)
    assert rows[3]._own.get_seq_length() == 0  # its entries are still in the stack
    first_many(rows, [_ids([*c, 7]) for c in contexts])
    stack = rows[0]._stack
    extend_many(rows[:2], 0.0)  # two of four: they read in a stack of their own
    assert rows[0]._stack is rows[1]._stack is not stack and rows[2]._stack is rows[3]._stack is None
    assert [r._own.get_seq_length() for r in rows[2:]] == [7, 7]  # the old stack's entries went back
    for r, ctx in enumerate(contexts[:3]):
        assert going[r][0].tolist() == greedy_continuation(model, ctx.tolist(), 4)
    for row, ctx in zip(rows, contexts, strict=True):
        ctx = _ids([*ctx, 7])
        assert row.chain(ctx).tolist() == greedy_continuation(model, ctx.tolist(), 4)


def test_reads_over_different_models_or_long_ones_go_alone_and_agree() -> None:
    a, b = _llama(0), _llama(2)
    calls_a, calls_b = _forwards(a), _forwards(b)
    rows = [ModelDrafter(a, 4), ModelDrafter(b, 4), ModelDrafter(a, 4)]
    contexts = [_ids(range(1, 9)), _ids(range(2, 10)), _ids(range(3, 3 + ALONE_FROM))]
    first_many(rows, contexts)
    assert calls_a == [1, 1] and calls_b == [1]  # row 2's read is long: alone
    chains = extend_many(rows, 0.0)
    assert calls_a[2:] == [2] * 3 and calls_b[1:] == [1] * 3
    for model, ctx, (tokens, _) in zip((a, b, a), contexts, chains, strict=True):
        assert tokens.tolist() == greedy_continuation(model, ctx.tolist(), 4)


def test_a_batch_is_checked_before_any_forward_and_a_failed_one_starts_every_row_over() -> None:
    model = _llama(0)
    calls = _forwards(model)
    rows = [ModelDrafter(model, 4) for _ in range(2)]
    with pytest.raises(ValueError, match="only once"):
        first_many([rows[0], rows[0]], [_ids([1, 2]), _ids([3, 4])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        first_many(rows, [_ids([1, 2]), _ids([3, VOCAB])])
    assert calls == []
    calls.clear()
    contexts = [_ids(range(10, 20)), _ids(range(20, 32))]
    first_many(rows, contexts)
    extend_many(rows, 0.0)
    forward = model.forward

    def fails(*args: object, **kwargs: object) -> object:
        forward(*args, **kwargs)  # the caches took the ids, then the forward failed
        raise RuntimeError("out of memory")

    model.forward = fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        first_many(rows, [_ids([*c, 5]) for c in contexts])
    del model.forward
    assert all(r._held.size == 0 and r._cache.get_seq_length() == 0 for r in rows)
    first_many(rows, contexts)
    for ctx, (tokens, _) in zip(contexts, extend_many(rows, 0.0), strict=True):
        assert tokens.tolist() == greedy_continuation(model, ctx.tolist(), 4)


def test_the_benchmark_times_both_ways_over_the_same_chains() -> None:
    model = _llama(0)
    prompts = [_ids(np.arange(n) % VOCAB) for n in (30, 12, 50)]
    config = DraftModelBenchConfig(batches=(1, 3), k=4, accept=1, steps=3, prompt_tokens=40)
    report = run_draft_model_bench(lambda: ModelDrafter(model, 4), prompts, config)
    assert report["chains_agree"] is True
    assert set(report["batches"]) == {1, 3}
    for row in report["batches"].values():
        assert 0 < row["together_ms_p50"] <= row["together_ms_p90"] and 0 < row["alone_ms_p50"] <= row["alone_ms_p90"]
    some = run_draft_model_bench(
        lambda: ModelDrafter(model, 4), prompts, DraftModelBenchConfig(batches=(3,), k=4, accept=1, steps=3, going=1)
    )
    assert some["chains_agree"] is True and some["going"] == 1
    with pytest.raises(ValueError, match="3 prompts for a batch of 4"):
        run_draft_model_bench(lambda: ModelDrafter(model, 4), prompts, DraftModelBenchConfig(batches=(4,), k=4))

"""A draft model beside the cache in the reference decoder: its chains equal the model's own
greedy generation however the context moves, the draft expected to give more wins each step,
output stays greedy's, and the cache being empty or down leaves the model drafting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.generate import InProcessDrafter, ServiceDrafter, run_generate
from cache_service.host.embedded_redis import free_port
from decoder_client.chain_model import BesideCache, expected_accepted
from decoder_client.client import ClientConfig
from decoder_client.draft_model import ModelDrafter
from decoder_client.reference_decoder import ReferenceDecoder
from indexer.drafter import DraftParams
from indexer.tree_builder import DraftTree
from tests.client.conftest import greedy_continuation

VOCAB = 128


def _llama(seed: int, *, positions: int = 2048) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def _ids(values: Iterable[int] | np.ndarray) -> np.ndarray:
    if not isinstance(values, np.ndarray):
        values = list(values)
    return np.asarray(values, dtype=np.int32)


def _empty(context: np.ndarray) -> DraftTree:
    return DraftTree.empty()


def _fixed(tokens: list[int], first_score: float) -> Callable[[np.ndarray], DraftTree]:
    """A cache that always drafts ``tokens`` as a chain, its first token ``first_score`` likely."""

    def draft(context: np.ndarray) -> DraftTree:
        n = len(tokens)
        scores = first_score * np.linspace(1.0, 0.5, n).astype(np.float32)
        return DraftTree(_ids(tokens), np.arange(-1, n - 1, dtype=np.int32), np.zeros(n, np.uint8), scores)

    return draft


def test_chains_equal_the_models_greedy_generation_as_the_context_moves() -> None:
    # The KV cache is kept between calls: accepted tokens it drafted are reused, a context cut
    # back (a rejected draft) or another request crops it. Every chain must still be exactly
    # what the model's own generate gives after that context.
    model = _llama(0)
    drafter = ModelDrafter(model, 6)
    rng = np.random.default_rng(1)
    context = _ids(rng.integers(0, VOCAB, 20))
    held = 0  # how many of the context's ids the model's cache already held
    for step in range(16):
        before = drafter.fed
        chain = drafter.chain(context)
        assert chain.tolist() == greedy_continuation(model, context.tolist(), 6), step
        assert drafter.fed - before == context.size - held + 5, step  # only what it had not read
        move = step % 4
        if move == 0:  # three of the chain accepted, then the bonus: the three are in the cache
            context, held = _ids([*context, *chain[:3], 5]), context.size + 3
        elif move == 1:  # nothing accepted
            context, held = _ids([*context, 7]), context.size
        elif move == 2:  # cut back below what the cache held: all but the last id is fed again
            context, held = context[:-4], context.size - 5
        else:  # a new request: nothing shared (the first id differs)
            context, held = _ids([int(context[0]) + 1, *rng.integers(0, VOCAB, 9)]) % VOCAB, 0
    assert drafter.forwards == 16 * 6  # one forward for the context, k - 1 for the chain


def test_a_context_is_checked_before_any_forward() -> None:
    drafter = ModelDrafter(_llama(0), 4)
    with pytest.raises(ValueError, match="dtype int32"):
        drafter.first(np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        drafter.first(_ids([1, VOCAB]))
    with pytest.raises(ValueError, match="must not be empty"):
        drafter.first(_ids([]))
    with pytest.raises(RuntimeError, match="no next token"):
        drafter.extend()
    assert drafter.forwards == 0
    for k in (0, 129):
        with pytest.raises(ValueError, match="k must be in"):
            ModelDrafter(_llama(0), k)


def test_a_chain_ends_where_its_chance_falls_below_the_cut_without_reading_on() -> None:
    model = _llama(0)
    context = _ids(range(10, 30))
    full = ModelDrafter(model, 8)
    full.first(context)
    tokens, probs = full.extend()
    reach = np.cumprod(probs.astype(np.float64))
    cut = float(reach[2])  # the third token is reached at exactly the cut: the fourth falls below it
    drafter = ModelDrafter(model, 8)
    drafter.first(context)
    before = drafter.forwards
    short, short_probs = drafter.extend(min_prob=cut)
    assert short.tolist() == tokens[:4].tolist()  # the first token below the cut, and no more
    assert np.array_equal(short_probs, probs[:4])
    assert drafter.forwards - before == 3  # not the 7 of the whole chain
    assert drafter.chain(context).tolist() == tokens.tolist()  # the next chain is whole again


def test_a_failed_forward_leaves_no_stale_cache_behind() -> None:
    model = _llama(0)
    drafter = ModelDrafter(model, 4)
    context = _ids(range(10, 40))
    drafter.chain(context[:20])  # the cache holds the first 20 ids and the chain's
    feed = drafter._feed

    def fails(ids: np.ndarray) -> np.ndarray:
        feed(ids)  # the cache took the ids, then the forward failed
        raise RuntimeError("out of memory")

    drafter._feed = fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        drafter.first(context)
    drafter._feed = feed  # type: ignore[method-assign]
    before = drafter.fed
    assert drafter.chain(context).tolist() == greedy_continuation(model, context.tolist(), 4)
    assert drafter.fed - before == context.size + 3  # read again from the start


def test_a_context_past_the_models_positions_leaves_the_cache_drafting() -> None:
    drafter = ModelDrafter(_llama(0, positions=32), 4)
    assert drafter.first(_ids(range(28))) is not None  # 28 + a chain of 4 fits
    assert drafter.first(_ids(range(29))) is None
    assert drafter.chain(_ids(range(29))).size == 0
    cache = _fixed([3, 4], 0.01)
    beside = BesideCache(cache, drafter)
    assert beside(_ids(range(29))).tokens.tolist() == [3, 4]
    assert beside.model_steps == 0


def test_the_draft_expected_to_give_more_wins() -> None:
    model = _llama(0)
    context = _ids([5, 9, 17, 33, 65])
    nxt = ModelDrafter(model, 4).first(context)
    assert nxt is not None and 0 < nxt.prob < 0.5
    # Nothing seen yet: the model's chain of 4 is expected to give its probability's geometric
    # run; the fixed cache's chain of 3 gives 2.25 times its first token's chance.
    theirs = float(nxt.reaches(4).sum())
    assert theirs == pytest.approx(sum(nxt.prob ** (d + 1) for d in range(4)))
    # The cache's chain when more of it is expected to be accepted ...
    likelier = BesideCache(_fixed([1, 2, 3], 1.2 * theirs / 2.25), ModelDrafter(model, 4))
    assert likelier(context).tokens.tolist() == [1, 2, 3]
    assert (likelier.model_steps, likelier.model.forwards) == (0, 1)  # no chain was drafted
    # ... the model's otherwise, scored by the product of its own probabilities.
    less = BesideCache(_fixed([1, 2, 3], 0.8 * theirs / 2.25), ModelDrafter(model, 4))
    tree = less(context)
    assert tree.tokens.tolist() == greedy_continuation(model, context.tolist(), 4)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.scores[0] == pytest.approx(nxt.prob) and bool(np.all(np.diff(tree.scores) <= 0))
    assert less.model_steps == 1
    # Each node of a tree is reached with its own chance: they add up.
    roots = DraftTree(_ids([1, 2, 3]), _ids([-1, -1, 0]), np.zeros(3, np.uint8), np.array([0.3, 0.2, 0.1], np.float32))
    assert expected_accepted(roots) == pytest.approx(0.6)


def test_decoding_with_the_target_as_its_own_draft_accepts_every_chain() -> None:
    # The draft model's KV cache follows the decoder's steps: drafting for itself, the target
    # accepts all k tokens of every chain, and the output is its greedy continuation.
    target = _llama(0)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 12)]
    beside = BesideCache(_empty, ModelDrafter(target, 5))
    tokens, stats = ReferenceDecoder(target).generate(prompt, 40, drafter=beside)
    assert tokens == greedy_continuation(target, prompt, 40)
    assert stats.accepted == [5] * (stats.steps - 1) + [stats.accepted[-1]]
    assert beside.model_steps == stats.steps
    assert beside.accepted == {"model": 5 * (stats.steps - 1), "cache": 0}  # the last step's is never seen


def test_a_model_right_more_often_than_it_says_takes_over_from_a_surer_cache() -> None:
    # The target as its own draft is right every time, though a tiny random model's
    # probabilities are low: a cache claiming more for a chain that is never accepted is
    # proposed at first, and the model's track record soon outweighs it.
    target = _llama(0)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 12)]
    drafter = ModelDrafter(target, 4)
    nxt = drafter.first(_ids(prompt))
    drafter.reset()
    assert nxt is not None and nxt.prob < 0.3
    wrong = [t for t in range(VOCAB) if t not in greedy_continuation(target, prompt, 80)][:3]
    beside = BesideCache(_fixed(wrong, 0.6), drafter)
    tokens, stats = ReferenceDecoder(target).generate(prompt, 80, drafter=beside)
    assert tokens == greedy_continuation(target, prompt, 80)
    assert 0 < beside.model_steps < stats.steps  # the cache's at first, then the model's
    assert stats.accepted[:3] == [0, 0, 0] and stats.accepted[-4:-1] == [4, 4, 4]
    # Every step's first token was right; the last step's truth is never seen. Past a right
    # first token, each proposed chain's other 3 were right too.
    assert drafter.record.seen.sum() == stats.steps - 1 == drafter.record.right.sum()
    assert drafter.record.onward_seen.sum() == 3 * (beside.model_steps - 1) == drafter.record.onward_right.sum()


def test_a_cache_right_more_often_than_its_chances_say_takes_over_from_the_model() -> None:
    # The cache drafts the target's own next 3 tokens but claims 0.1% for each; a random model
    # beside it is surer and rarely right. Its chains go first, and every step the target's
    # tokens show how far the cache's draft would have gone: its record soon says what such a
    # draft is worth, and the cache's drafts go.
    target, other = _llama(0), _llama(1)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 12)]
    truth = prompt + greedy_continuation(target, prompt, 60)

    beside = BesideCache(_knowing(truth, 3, 1e-3), ModelDrafter(other, 4))
    tokens, stats = ReferenceDecoder(target).generate(prompt, 40, drafter=beside)
    assert tokens == truth[len(prompt) : len(prompt) + 40]
    assert 0 < beside.model_steps < 4 and stats.accepted[-4:-1] == [3, 3, 3]
    assert beside.record.worth(3e-3) > 1.5  # claimed 0.003, worth nearly 3 (8 drafts of pull at the claim)


class _SlowDrafter(ModelDrafter):
    """A model whose every forward takes 30 ms more: its reads, not verification, are dear."""

    @classmethod
    def _feed_many(cls, models: Any, feeds: Any) -> list[np.ndarray]:
        time.sleep(0.03)
        return super()._feed_many(models, feeds)


def _knowing(truth: list[int], n: int, claim: float) -> Callable[[np.ndarray], DraftTree]:
    """A cache that drafts the target's own next ``n`` tokens, claiming ``claim`` for each."""

    def draft(context: np.ndarray) -> DraftTree:
        nxt = _ids(truth[context.size : context.size + n])
        parents = np.arange(-1, nxt.size - 1, dtype=np.int32)
        return DraftTree(nxt, parents, np.zeros(nxt.size, np.uint8), np.full(nxt.size, claim, np.float32))

    return draft


@pytest.mark.parametrize("dear", ["verifying", "reading"])
def test_where_the_step_cost_is_known_the_draft_that_brings_more_a_second_goes(dear: str) -> None:
    # The target drafts for itself, chains of 4 always right; the cache drafts its next token,
    # always right too. Where verifying is dear, the model's reads are nothing beside it, and its
    # longer chains go once its record says they are right. Where the model's reads are dear (30
    # ms a forward, verifying next to nothing), its chain costs 3 reads past its first, and the
    # step after the cache's draft 1 read of 2 tokens: the cache's drafts go once the model's
    # reads have been timed, and the model does not even read the steps where its chain could
    # not pay.
    target = _llama(0)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 12)]
    truth = prompt + greedy_continuation(target, prompt, 80)
    drafter = ModelDrafter(target, 4) if dear == "verifying" else _SlowDrafter(target, 4)
    verify = (lambda n: 10.0 + n) if dear == "verifying" else (lambda n: 1e-6 * (1 + n))
    beside = BesideCache(_knowing(truth, 1, 0.7), drafter, verify)
    tokens, stats = ReferenceDecoder(target).generate(prompt, 80, drafter=beside)
    assert tokens == truth[len(prompt) : len(prompt) + 80]
    assert drafter.read_seconds is not None and drafter.read_seconds > 0
    if dear == "verifying":
        assert beside.model_steps >= 3 and beside.skipped == 0 and stats.accepted[-4:-1] == [4, 4, 4]
    else:
        assert beside.model_steps <= 2 and stats.accepted[-4:-1] == [1, 1, 1] and beside.skipped > 5
    assert drafter.forwards == stats.steps - beside.skipped + 3 * beside.model_steps


def test_a_different_draft_model_beside_the_real_cache_is_lossless() -> None:
    # Another random model drafts mostly wrong guesses; the engine's chains draft from the
    # request's own repeats. Whichever is verified, the output is the target's greedy one.
    target, draft = _llama(0), _llama(1)
    rng = np.random.default_rng(3)
    phrase = [int(t) for t in rng.integers(0, VOCAB, 8)]
    prompt = phrase * 3
    cache = InProcessDrafter(VOCAB, DraftParams(budget=16, chain=6))
    beside = BesideCache(cache, ModelDrafter(draft, 6))
    tokens, stats = ReferenceDecoder(target).generate(prompt, 48, drafter=beside, topk=4)
    assert tokens == greedy_continuation(target, prompt, 48)
    assert beside.steps == stats.steps
    assert sum(beside.accepted.values()) <= sum(stats.accepted)


def test_a_cache_that_is_down_leaves_the_model_drafting() -> None:
    # No service listens: the client falls back at once (prompt lookup over the request), and
    # the model's chain goes wherever that fallback has nothing likelier.
    target = _llama(0)
    config = ClientConfig(target=f"127.0.0.1:{free_port()}", namespace="none", params=DraftParams(chain=5))
    cache = ServiceDrafter(config)
    beside = BesideCache(cache, ModelDrafter(target, 5))
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, VOCAB, 12)]
    try:
        tokens, stats = ReferenceDecoder(target).generate(prompt, 30, drafter=beside)
    finally:
        cache.finish()
    assert tokens == greedy_continuation(target, prompt, 30)
    assert cache._client.stats.fallback > 0
    assert beside.model_steps > 0 and stats.mat > 2.0


def test_generate_with_smollm2_beside_the_cache_is_lossless(smollm2: Any) -> None:
    # The real model as its own draft (the only model here): every step but the last proposes
    # its chain and every chain is accepted whole; the output is greedy decoding's.
    model, tokenizer = smollm2
    drafter = InProcessDrafter(len(tokenizer), DraftParams(budget=16, chain=6))
    prompt = "Name three prime numbers and say why each is prime."
    result = run_generate(
        model, tokenizer, prompt, drafter, max_new_tokens=30, cost_aware=False, draft_model=ModelDrafter(model, 6)
    )
    assert result["identical"]
    ours = result["draftcache"]
    assert ours["model_steps"] > 0 and ours["accepted_by_drafter"]["model"] > 0
    assert ours["mat"] > 3.0


def test_generate_refuses_a_draft_model_that_cannot_read_the_targets_ids(
    smollm2: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cache_service.cli import main

    _llama(0).save_pretrained(tmp_path / "small")
    code = main(["generate", "--prompt", "hi", "--draft-model", str(tmp_path / "small"), "--chain", "4"])
    assert code == 2
    assert f"the draft model reads {VOCAB} ids; the target's tokenizer has 49152" in capsys.readouterr().err

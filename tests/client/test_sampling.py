"""Sampling through the reference decoder: its output follows the target's own distribution.

A tiny random Llama (vocabulary 8) gives an exact distribution over the first three generated
tokens by enumeration (512 sequences). Thousands of seeded runs through the decoder, with a
fixed draft tree holding likely and unlikely tokens and without one, must pass a chi-square
goodness-of-fit test against it, and deliberately wrong samplers must fail the same test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from decoder_client import reference_decoder
from decoder_client.reference_decoder import ReferenceDecoder, sample_accept, within_depth
from indexer.tree_builder import DraftTree
from tests.client.conftest import greedy_continuation

VOCAB = 8
PROMPT = [1, 5, 2, 7]
DEPTH = 3  # generated tokens whose joint distribution is tested
RUNS = 2000
ALPHA = 1e-3  # a correct sampler fails one seed in a thousand; wrong ones must fall far below

Sampler = Callable[[np.ndarray, np.ndarray, torch.Tensor, "torch.Generator | None"], tuple[list[int], int]]


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaForCausalLM]:
    """Seeded 1-layer Llama with large weights, so its distributions mix likely and rare tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny forwards: threads only add contention
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )
    yield LlamaForCausalLM(config).eval()
    torch.set_num_threads(threads)


@torch.inference_mode()
def exact_distribution(
    model: LlamaForCausalLM,
    temperature: float,
    top_p: float,
    top_k: int = 0,
    processors: Sequence[LogitsProcessor] = (),
) -> dict[tuple[int, ...], float]:
    """P(first DEPTH tokens) by enumeration: every sequence scored directly, processed and warped
    as transformers does (each position's processors seeing the prefix up to it)."""
    seqs = torch.tensor([[*PROMPT, *rest] for rest in np.ndindex(*(VOCAB,) * (DEPTH - 1))])
    logits = model(seqs).logits.float()
    rows = []
    for step in range(DEPTH):
        at = len(PROMPT) + step  # the prefix that produces the step's token
        scores = logits[:, at - 1]
        for processor in processors:
            scores = processor(seqs[:, :at], scores)
        scores = TemperatureLogitsWarper(temperature)(seqs, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(seqs, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(seqs, scores)
        rows.append(scores)
    probs = torch.stack(rows, dim=1).softmax(dim=-1).double()
    joint: dict[tuple[int, ...], float] = {}
    for row, rest in enumerate(np.ndindex(*(VOCAB,) * (DEPTH - 1))):
        prefix = 1.0
        for step, token in enumerate(rest):
            prefix *= float(probs[row, step, token])
        for last in range(VOCAB):
            joint[(*rest, last)] = prefix * float(probs[row, DEPTH - 1, last])
    return joint


def chi_square_pvalue(observed: Counter[tuple[int, ...]], expected_probs: dict[tuple[int, ...], float]) -> float:
    """Pearson's goodness-of-fit p-value; cells expecting fewer than 5 counts are pooled into one.

    An outcome the target cannot produce at all gives 0, however rare.
    """
    if any(expected_probs[cell] == 0 for cell in observed):
        return 0.0
    n = sum(observed.values())
    cells = sorted((n * p, observed[cell]) for cell, p in expected_probs.items() if p > 0)
    alone = [(e, o) for e, o in cells if e >= 5]
    pool_e, pool_o = sum(e for e, o in cells if e < 5), sum(o for e, o in cells if e < 5)
    while alone and pool_e < 5:  # a pool still too small takes the smallest cells standing alone
        e, o = alone.pop(0)
        pool_e, pool_o = pool_e + e, pool_o + o
    if pool_e:
        alone.append((pool_e, pool_o))
    stat = sum((o - e) ** 2 / e for e, o in alone)
    df, half_stat = torch.tensor((len(alone) - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, half_stat))


def draft_tree(first_probs: dict[int, float]) -> DraftTree:
    """A fixed tree (the same every step) over the first step's ranking: likely, mid and rare tokens.

    Three children at the root, the rarest tried first; chains up to depth 3 under the likeliest.
    """
    rank = sorted(first_probs, key=first_probs.__getitem__, reverse=True)
    top, second, mid, rare = rank[0], rank[1], rank[3], rank[-1]
    #          0     1    2     3       4    5    6      7
    tokens = [rare, top, mid, second, top, top, rare, second]
    parents = [-1, -1, -1, 1, 1, 3, 4, 0]
    n = len(tokens)
    return DraftTree(
        np.array(tokens, np.int32), np.array(parents, np.int32), np.zeros(n, np.uint8), np.ones(n, np.float32)
    )


def sample_counts(
    decoder: ReferenceDecoder,
    tree: DraftTree | None,
    temperature: float,
    top_p: float,
    seed: int,
    top_k: int = 0,
    processors: Sequence[LogitsProcessor] = (),
) -> tuple[Counter[tuple[int, ...]], list[int]]:
    """How often each DEPTH-token continuation came out over RUNS seeded runs, and accepted drafts per step."""
    generator = torch.Generator().manual_seed(seed)
    drafter = None if tree is None else (lambda ctx: tree)
    counts: Counter[tuple[int, ...]] = Counter()
    accepted: list[int] = []
    for _ in range(RUNS):
        out, stats = decoder.generate(
            PROMPT,
            DEPTH,
            drafter=drafter,
            temperature=temperature,
            top_p=top_p,
            generator=generator,
            top_k=top_k,
            logits_processor=processors,
        )
        counts[tuple(out)] += 1
        accepted += stats.accepted
        assert stats.new_tokens == len(out) == DEPTH and sum(stats.accepted) + stats.steps >= DEPTH
        done = np.cumsum([0, *(a + 1 for a in stats.accepted[:-1])])  # tokens before each step
        assert stats.drafted == [0 if tree is None else len(within_depth(tree, DEPTH - 1 - d)) for d in done]
    return counts, accepted


def first_token_probs(joint: dict[tuple[int, ...], float]) -> dict[int, float]:
    marginal: dict[int, float] = dict.fromkeys(range(VOCAB), 0.0)
    for seq, p in joint.items():
        marginal[seq[0]] += p
    return marginal


# --- the distribution tests ----------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_p"), [(1.2, 1.0), (1.0, 0.8)])
def test_drafted_sampling_follows_the_target_distribution(
    model: LlamaForCausalLM, temperature: float, top_p: float
) -> None:
    joint = exact_distribution(model, temperature, top_p)
    tree = draft_tree(first_token_probs(joint))
    counts, accepted = sample_counts(ReferenceDecoder(model), tree, temperature, top_p, seed=1)
    pvalue = chi_square_pvalue(counts, joint)
    print(f"drafted T={temperature} top_p={top_p}: chi-square p = {pvalue:.3g}, MAT {np.mean(accepted) + 1:.2f}")
    assert pvalue > ALPHA
    assert all(joint[seq] > 0 for seq in counts)  # never a token outside the nucleus
    assert np.mean(accepted) > 0.3  # the likely drafts do get accepted: the tree is exercised


def test_sampling_with_top_k_and_a_repetition_penalty_follows_the_target_distribution(
    model: LlamaForCausalLM,
) -> None:
    # The penalty moves each position's distribution by its own prefix (a node's root path in
    # the tree); top-k cuts each to its 4 likeliest.
    processors = [RepetitionPenaltyLogitsProcessor(2.0)]
    joint = exact_distribution(model, 1.0, 1.0, top_k=4, processors=processors)
    assert joint != exact_distribution(model, 1.0, 1.0, top_k=4)  # the penalty does change it
    tree = draft_tree(first_token_probs(exact_distribution(model, 1.0, 1.0)))
    counts, accepted = sample_counts(ReferenceDecoder(model), tree, 1.0, 1.0, seed=3, top_k=4, processors=processors)
    pvalue = chi_square_pvalue(counts, joint)
    print(f"drafted top_k=4, repetition penalty 2: chi-square p = {pvalue:.3g}, MAT {np.mean(accepted) + 1:.2f}")
    assert pvalue > ALPHA
    assert all(joint[seq] > 0 for seq in counts)  # never a token outside each position's top 4
    assert np.mean(accepted) > 0.1


def test_undrafted_sampling_follows_the_target_distribution(model: LlamaForCausalLM) -> None:
    joint = exact_distribution(model, 1.2, 1.0)
    counts, accepted = sample_counts(ReferenceDecoder(model), None, 1.2, 1.0, seed=2)
    pvalue = chi_square_pvalue(counts, joint)
    print(f"undrafted control: chi-square p = {pvalue:.3g}")
    assert pvalue > ALPHA and set(accepted) == {0}


def _accept_every_child(
    tokens: np.ndarray, parents: np.ndarray, probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Wrong: takes the first child at every level without testing it, then samples the bonus."""
    path, node = [], -1
    while (children := np.flatnonzero(parents == node)).size:
        node = int(children[0])
        path.append(node)
    return path, int(torch.multinomial(probs[node + 1].double(), 1, generator=generator))


def _bonus_ignores_rejections(
    tokens: np.ndarray, parents: np.ndarray, probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Wrong, subtly: the right walk, but the bonus drawn from the full row, rejected mass included."""
    path, _ = sample_accept(tokens, parents, probs, generator)
    row = probs[(path[-1] if path else -1) + 1].double()
    return path, int(torch.multinomial(row, 1, generator=generator))


@pytest.mark.parametrize("wrong", [_accept_every_child, _bonus_ignores_rejections])
def test_wrong_samplers_fail_the_same_test(
    model: LlamaForCausalLM, wrong: Sampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    joint = exact_distribution(model, 1.2, 1.0)
    monkeypatch.setattr(reference_decoder, "sample_accept", wrong)
    counts, _ = sample_counts(ReferenceDecoder(model), draft_tree(first_token_probs(joint)), 1.2, 1.0, seed=1)
    pvalue = chi_square_pvalue(counts, joint)
    print(f"{wrong.__name__}: chi-square p = {pvalue:.3g}")
    assert pvalue < 1e-6  # the test has power: far beyond the chance of a seed-level fluke


def test_chi_square_pvalue_of_known_counts() -> None:
    # Fair coin, 60 heads in 100: X^2 = 4 on 1 degree of freedom, p = 0.0455.
    fair: dict[tuple[int, ...], float] = {(0,): 0.5, (1,): 0.5}
    assert chi_square_pvalue(Counter({(0,): 60, (1,): 40}), fair) == pytest.approx(0.0455, abs=1e-4)
    assert chi_square_pvalue(Counter({(0,): 50, (1,): 50}), fair) == pytest.approx(1.0)
    # An outcome the target never produces fails outright, however few.
    assert chi_square_pvalue(Counter({(0,): 99, (2,): 1}), {**fair, (2,): 0.0}) == 0.0


# --- decoding with sampling ----------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(model: LlamaForCausalLM) -> None:
    decoder = ReferenceDecoder(model)
    tree = draft_tree(first_token_probs(exact_distribution(model, 1.0, 1.0)))

    def run(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return decoder.generate(PROMPT, 24, drafter=lambda ctx: tree, temperature=1.0, generator=generator)[0]

    assert run(7) == run(7)
    assert run(7) != run(8)  # the generator does drive the draws


@torch.inference_mode()
def test_near_zero_temperature_is_greedy_over_many_steps(model: LlamaForCausalLM) -> None:
    # At temperature 1e-4 every target row is one-hot on the argmax, so sampling must reproduce
    # greedy decoding token for token: a check of the sampling path's cache pruning across steps.
    ref = greedy_continuation(model, PROMPT, 30)
    tree = draft_tree(first_token_probs(exact_distribution(model, 1.0, 1.0)))
    out, stats = ReferenceDecoder(model).generate(
        PROMPT, 30, drafter=lambda ctx: tree, temperature=1e-4, generator=torch.Generator().manual_seed(0)
    )
    assert out == ref
    assert stats.mat > 1.2  # drafts were accepted, so pruned caches were reused


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_temperature_that_overflows_the_logits_is_greedy(model: LlamaForCausalLM, top_p: float) -> None:
    # Logits divided by 1e-40 pass float32's largest value: the target rows must still be one-hot
    # on the argmax, not NaN (torch.multinomial refused them).
    ref = greedy_continuation(model, PROMPT, 12)
    tree = draft_tree(first_token_probs(exact_distribution(model, 1.0, 1.0)))
    out, _ = ReferenceDecoder(model).generate(
        PROMPT, 12, drafter=lambda ctx: tree, temperature=1e-40, top_p=top_p, generator=torch.Generator()
    )
    assert out == ref


@pytest.mark.parametrize(("temperature", "top_p"), [(-1.0, 1.0), (1.0, 0.0), (1.0, 1.01)])
def test_decoder_refuses_bad_sampling_settings(model: LlamaForCausalLM, temperature: float, top_p: float) -> None:
    with pytest.raises(ValueError):
        ReferenceDecoder(model).generate(PROMPT, 4, temperature=temperature, top_p=top_p)


@pytest.mark.parametrize("top_k", [-1, 2.5, True])
def test_decoder_refuses_a_bad_top_k(model: LlamaForCausalLM, top_k: int) -> None:
    with pytest.raises(ValueError, match="top_k"):
        ReferenceDecoder(model).generate(PROMPT, 4, temperature=1.0, top_k=top_k)

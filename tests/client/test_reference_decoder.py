"""Tree attention and the reference decoder: literal trees, a tiny random Llama, the real SmolLM2."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from decoder_client.reference_decoder import (
    DecodeStats,
    ReferenceDecoder,
    VerifiedTopk,
    cache_keyword,
    greedy_accept,
    prune_cache,
    within_depth,
)
from decoder_client.tree_attention import check_parents, tree_attention_mask, tree_position_ids
from indexer.prompt_lookup import prompt_lookup
from indexer.tree_builder import DraftTree
from tests.client.conftest import greedy_continuation

Drafter = Callable[[np.ndarray], DraftTree]

# root r, then n0 <- r, n1 <- n0, n2 <- r, n3 <- n1, n4 <- n0
PARENTS = np.array([-1, 0, -1, 1, 0], dtype=np.int32)


def _tree(tokens: list[int], parents: list[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree(
        np.array(tokens, np.int32), np.array(parents, np.int32), np.zeros(n, np.uint8), np.ones(n, np.float32)
    )


def _lookup(ctx: np.ndarray) -> DraftTree:
    return DraftTree.chain(prompt_lookup(ctx, num_tokens=8))


def _noisy_drafter(prompt_len: int, truth: list[int], seed: int, vocab: int) -> Drafter:
    """Drafts the true continuation (20% of tokens corrupted) among wrong siblings, shuffled."""
    rng = np.random.default_rng(seed)

    def draft(ctx: np.ndarray) -> DraftTree:
        done = ctx.size - prompt_len
        toks: list[int] = []
        pars: list[int] = []
        parent = -1
        for token in truth[done : done + 6]:
            for _ in range(int(rng.integers(0, 3))):  # wrong siblings, half of them with a child
                toks.append(int(rng.integers(vocab)))
                pars.append(parent)
                if rng.random() < 0.5:
                    toks.append(int(rng.integers(vocab)))
                    pars.append(len(toks) - 2)
            toks.append(token if rng.random() > 0.2 else int(rng.integers(vocab)))
            pars.append(parent)
            parent = len(toks) - 1
        return _shuffled(toks, pars, rng)

    return draft


def _shuffled(toks: list[int], pars: list[int], rng: np.random.Generator) -> DraftTree:
    """The same tree in a random wire order that still puts parents before children."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(pars):
        children.setdefault(p, []).append(i)
    order: list[int] = []
    ready = list(children.get(-1, []))
    while ready:
        node = ready.pop(int(rng.integers(len(ready))))
        order.append(node)
        ready += children.get(node, [])
    new = {old: i for i, old in enumerate(order)}
    return _tree([toks[o] for o in order], [new[pars[o]] if pars[o] >= 0 else -1 for o in order])


# --- tree attention: literal trees ---------------------------------------------------------------


def test_mask_lets_each_node_see_past_root_ancestors_and_itself() -> None:
    mask = tree_attention_mask(PARENTS, past_len=2)
    assert mask.shape == (1, 1, 6, 8) and mask.dtype == torch.float32
    allowed = (mask[0, 0] == 0).int().tolist()
    #             p0 p1  r n0 n1 n2 n3 n4
    assert allowed == [
        [1, 1, 1, 0, 0, 0, 0, 0],  # root: the past and itself
        [1, 1, 1, 1, 0, 0, 0, 0],  # n0: root, itself
        [1, 1, 1, 1, 1, 0, 0, 0],  # n1: root, n0, itself
        [1, 1, 1, 0, 0, 1, 0, 0],  # n2: a second child of the root sees nothing of n0's branch
        [1, 1, 1, 1, 1, 0, 1, 0],  # n3: root, n0, n1, itself
        [1, 1, 1, 1, 0, 0, 0, 1],  # n4: n1's sibling sees root and n0 only
    ]
    # Everything else is the dtype's most negative value, never -inf (no NaN rows).
    assert set(mask[0, 0][mask[0, 0] != 0].tolist()) == {torch.finfo(torch.float32).min}


def test_mask_follows_the_requested_dtype() -> None:
    mask = tree_attention_mask(PARENTS, past_len=0, dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.min().item() == torch.finfo(torch.bfloat16).min


def test_positions_are_past_length_plus_depth() -> None:
    # depths: root 0, n0 1, n1 2, n2 1, n3 3, n4 2
    assert tree_position_ids(PARENTS, past_len=2).tolist() == [[2, 3, 4, 3, 5, 4]]


def test_empty_tree_is_the_root_alone() -> None:
    empty = np.zeros(0, dtype=np.int32)
    assert (tree_attention_mask(empty, past_len=3)[0, 0] == 0).all()
    assert tree_position_ids(empty, past_len=3).tolist() == [[3]]


@pytest.mark.parametrize(
    "parents",
    [np.array([-1, 1], np.int32), np.array([-2], np.int32), np.array([-1, 0], np.int64), np.zeros((1, 1), np.int32)],
)
def test_malformed_parents_are_rejected(parents: np.ndarray) -> None:
    with pytest.raises(ValueError):
        check_parents(parents)


def test_greedy_accept_walks_the_argmax_path() -> None:
    toks = np.array([5, 6, 7, 8, 9], dtype=np.int32)  # n0=5, n1=6 <- n0, n2=7, n3=8 <- n1, n4=9 <- n0
    # argmax over [r, n0, n1, n2, n3, n4]: r -> 5 (n0), n0 -> 6 (n1), n1 -> 8 (n3).
    assert greedy_accept(toks, PARENTS, np.array([5, 6, 8, 0, 0, 0])) == [0, 1, 3]
    # n0 -> 9 takes the other branch, n4.
    assert greedy_accept(toks, PARENTS, np.array([5, 9, 8, 0, 0, 0])) == [0, 4]
    # r -> 7 picks the root's second child, n2, whose own argmax (0) has no child.
    assert greedy_accept(toks, PARENTS, np.array([7, 6, 8, 0, 0, 0])) == [2]
    # r -> 9: no child of the root holds 9 (n4 does, but under n0).
    assert greedy_accept(toks, PARENTS, np.array([9, 0, 0, 0, 0, 0])) == []


def test_prune_cache_keeps_past_root_and_accepted_path() -> None:
    cache = DynamicCache()
    keys = torch.arange(8.0).view(1, 1, 8, 1)  # past 2, root, 5 tree slots
    cache.update(keys, -keys, 0)
    prune_cache(cache, start=3, path=[0, 2])
    assert cache.layers[0].keys.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 5.0]
    assert cache.layers[0].values.flatten().tolist() == [-0.0, -1.0, -2.0, -3.0, -5.0]
    assert cache.get_seq_length() == 5


def test_stats_count_the_bonus_token() -> None:
    stats = DecodeStats(accepted=[3, 0, 1], drafted=[5, 0, 4], new_tokens=7, seconds=2.0)
    assert stats.steps == 3 and stats.mat == pytest.approx(7 / 3) and stats.tokens_per_s == 3.5


# --- a tiny random Llama -------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@torch.inference_mode()
def test_chain_tree_reproduces_causal_logits(tiny_llama: Callable[[str], LlamaForCausalLM], attn: str) -> None:
    model = tiny_llama(attn)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    full = model(ids).logits[0]
    past = 7
    cache = DynamicCache(config=model.config)
    model(ids[:, :past], **{cache_keyword(model): cache})
    chain = np.arange(-1, ids.shape[1] - past - 2, dtype=np.int32)  # root + 4 chained nodes
    out = model(
        ids[:, past:],
        attention_mask=tree_attention_mask(chain, past),
        position_ids=tree_position_ids(chain, past),
        **{cache_keyword(model): cache},
    ).logits[0]
    assert torch.allclose(out, full[past:], rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_branches_score_like_their_own_root_path(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    past = torch.tensor([[3, 14, 15, 92]])
    root, toks = 65, [35, 89, 79, 32, 38]
    cache = DynamicCache(config=model.config)
    model(past, **{cache_keyword(model): cache})
    block = torch.tensor([[root, *toks]])
    n = past.shape[1]
    out = model(
        block,
        attention_mask=tree_attention_mask(PARENTS, n),
        position_ids=tree_position_ids(PARENTS, n),
        **{cache_keyword(model): cache},
    ).logits[0]
    # Each node's root path, as plain token sequences after the past and the root.
    paths = {0: [35], 1: [35, 89], 2: [79], 3: [35, 89, 32], 4: [35, 38]}
    for node, path in paths.items():
        plain = model(torch.tensor([[*past[0].tolist(), root, *path]])).logits[0, -1]
        assert torch.allclose(out[node + 1], plain, rtol=1e-5, atol=1e-6), node


@torch.inference_mode()
def test_tiny_decoder_matches_generate_for_every_drafter(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    prompt = [5, 17, 99, 5, 17, 42, 8]
    n = 40
    ref = greedy_continuation(model, prompt, n)
    decoder = ReferenceDecoder(model)
    drafters: list[Drafter | None] = [None, _lookup, _noisy_drafter(len(prompt), ref, seed=3, vocab=128)]
    for drafter in drafters:
        out, stats = decoder.generate(prompt, n, drafter=drafter)
        assert out == ref
        assert stats.new_tokens == n and sum(stats.accepted) + stats.steps >= n
    assert decoder.generate(prompt, n, drafter=None)[1].mat == 1.0  # no drafts: one token a step


@torch.inference_mode()
def test_topk_rows_are_the_verified_positions(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    """Each step hands the drafter a top-k row for every position it verified, before the next
    draft: the root's (after the context's last token) and each tree node's, rejected nodes
    included, each the target's own distribution after that node's token; the rows that produced
    the step's tokens start with those tokens, under greedy."""
    model = tiny_llama("sdpa")
    prompt = [5, 17, 99, 5, 17, 42, 8]
    seen: list[tuple[np.ndarray, DraftTree, VerifiedTopk]] = []

    class Recording:
        def __init__(self) -> None:
            self.inner = _noisy_drafter(len(prompt), ref, seed=5, vocab=128)
            self.last: tuple[np.ndarray, DraftTree] | None = None

        def __call__(self, context: np.ndarray) -> DraftTree:
            tree = self.inner(context)
            self.last = (context.copy(), tree)
            return tree

        def observe_topk(self, verified: VerifiedTopk) -> None:
            assert self.last is not None
            seen.append((*self.last, verified))

    ref = greedy_continuation(model, prompt, 30)
    drafter = Recording()
    out, stats = ReferenceDecoder(model).generate(prompt, 30, drafter=drafter, topk=3)
    assert out == ref and len(seen) == stats.steps
    rejected_rows = 0
    for (context, tree, v), accepted in zip(seen, stats.accepted, strict=True):
        produced = context.size - len(prompt)
        tree = within_depth(tree, len(ref) - produced - 1)  # verified: no node past the last token wanted
        assert v.after.tolist() == [int(context[-1]), *tree.tokens.tolist()]
        assert v.rows.shape == (len(tree) + 1, 3) and v.rows.dtype == np.int32
        assert v.produced().shape == (accepted + 1, 3)
        assert v.produced()[:, 0].tolist() == ref[produced : produced + accepted + 1]
        for node in set(range(len(tree))) - {int(p) - 1 for p in v.path}:  # a node verification rejected
            parents = [node]
            while tree.parents[parents[-1]] >= 0:
                parents.append(int(tree.parents[parents[-1]]))
            branch = [int(t) for t in context] + [int(tree.tokens[i]) for i in reversed(parents)]
            full = model(torch.tensor([branch])).logits[0, -1]
            assert set(v.rows[node + 1].tolist()) == set(full.topk(3).indices.tolist())
            rejected_rows += 1
    assert rejected_rows > 0  # the noisy drafter's trees hold nodes the target rejected


def test_cache_goes_by_the_name_the_model_takes_it(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    class Old(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: DynamicCache | None = None) -> None: ...

    class New(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, cache: DynamicCache | None = None) -> None: ...

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    model = tiny_llama("sdpa")
    with warnings.catch_warnings():  # no deprecated keyword reaches the installed transformers
        warnings.simplefilter("error", FutureWarning)
        out, _ = ReferenceDecoder(model).generate([5, 17, 99, 5, 17, 42, 8], 6, drafter=_lookup)
    assert len(out) == 6


@torch.inference_mode()
def test_tiny_decoder_stops_after_eos_like_generate(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    prompt = [1, 2, 3, 4]
    ref = greedy_continuation(model, prompt, 20)
    eos = ref[5]  # pretend a token emitted mid-way is the end of sequence
    ref_eos = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=eos)
    out, _ = ReferenceDecoder(model).generate(
        prompt, 20, drafter=_noisy_drafter(len(prompt), ref, seed=0, vocab=128), eos_token_id=eos
    )
    assert out == ref_eos[0, len(prompt) :].tolist() == ref[: ref.index(eos) + 1]


def test_decoder_validates_its_inputs(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    decoder = ReferenceDecoder(tiny_llama("sdpa"))
    out, stats = decoder.generate([1, 2], 0)
    assert out == [] and stats.steps == 0  # nothing asked, no forward run
    with pytest.raises(ValueError):
        decoder.generate([], 4)
    with pytest.raises(ValueError):  # a draft token outside the vocabulary
        decoder.generate([1, 2], 4, drafter=lambda ctx: _tree([128], [-1]))
    for prompt in ([1, 128], [1, -1], [1, 2**32 + 1]):  # a prompt id outside the vocabulary
        with pytest.raises(ValueError, match="prompt_ids"):
            decoder.generate(prompt, 4)


def test_within_depth_keeps_the_shallow_nodes_renumbered() -> None:
    tree = _tree([10, 11, 12, 13, 14], PARENTS.tolist())  # depths 1, 2, 1, 3, 2
    cut = within_depth(tree, 2)
    assert cut.tokens.tolist() == [10, 11, 12, 14] and cut.parents.tolist() == [-1, 0, -1, 0]
    assert len(cut.sources) == len(cut.scores) == 4
    assert within_depth(tree, 3) is tree and len(within_depth(tree, 0)) == 0


@torch.inference_mode()
def test_drafts_past_the_last_wanted_token_are_not_verified() -> None:
    # GPT-2 learns an embedding per position, 32 here: plain decoding of 20 + 12 tokens fits, and
    # a draft running past the 12th new token has no position to be verified at.
    torch.manual_seed(0)
    config = GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2, vocab_size=64, bos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    prompt, n = list(range(1, 21)), 12
    ref = greedy_continuation(model, prompt, n)
    truth = [*ref, *range(40)]  # right to the last wanted token, then on

    def oracle(ctx: np.ndarray) -> DraftTree:
        done = ctx.size - len(prompt)
        return DraftTree.chain(np.array(truth[done : done + 16], np.int32))

    decoder = ReferenceDecoder(model)
    out, stats = decoder.generate(prompt, n, drafter=oracle)
    assert out == ref and stats.accepted == [n - 1] and stats.drafted == [n - 1]  # 16 drafted, 11 verified
    out, _ = decoder.generate(prompt, n, drafter=_noisy_drafter(len(prompt), truth, seed=0, vocab=64))
    assert out == ref
    generator = torch.Generator().manual_seed(0)
    out, _ = decoder.generate(prompt, n, drafter=oracle, temperature=1.0, generator=generator)
    assert len(out) == n


def test_malformed_tree_arrays_are_refused(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    decoder = ReferenceDecoder(tiny_llama("sdpa"))
    flat = _tree([1, 2], [-1, 0])
    for tree in (
        DraftTree(flat.tokens[None], flat.parents[None], flat.sources, flat.scores),  # 2-D
        DraftTree(flat.tokens, flat.parents, flat.sources[:1], flat.scores),  # a short array
        _tree([1, 2, 3], [-1, 0, 7]),  # a parent out of range
    ):
        with pytest.raises(ValueError):
            decoder.generate([1, 2], 4, drafter=lambda ctx, tree=tree: tree)


# --- the real SmolLM2-135M-Instruct --------------------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Name a planet in the solar system.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]
NEW_TOKENS = 24


@dataclass
class Run:
    prompt: list[int]
    ref: list[int]
    ref_seconds: float
    outputs: dict[str, tuple[list[int], DecodeStats]]


@pytest.fixture(scope="module")
def smollm2_runs(smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> list[Run]:
    model, tokenizer = smollm2
    eos = int(model.generation_config.eos_token_id)
    decoder = ReferenceDecoder(model, tokenizer)
    runs = []
    with torch.inference_mode():
        for i, chat in enumerate(CHATS):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": chat}], add_generation_prompt=True, tokenize=False
            )
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            began = time.perf_counter()
            ids = torch.tensor([prompt])
            ref = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=eos)
            run = Run(prompt, ref[0, len(prompt) :].tolist(), time.perf_counter() - began, {})
            noisy = _noisy_drafter(len(prompt), run.ref, seed=i, vocab=len(tokenizer))
            for name, drafter in (("prompt_lookup", _lookup), ("noisy_tree", noisy)):
                run.outputs[name] = decoder.generate(prompt, NEW_TOKENS, drafter=drafter, eos_token_id=eos)
            runs.append(run)
    _report(runs)
    return runs


def _report(runs: list[Run]) -> None:
    ref_rate = sum(len(r.ref) for r in runs) / sum(r.ref_seconds for r in runs)
    print(f"\nmodel.generate greedy: {ref_rate:.1f} tokens/s")
    for name in runs[0].outputs:
        stats = [r.outputs[name][1] for r in runs]
        rate = sum(s.new_tokens for s in stats) / sum(s.seconds for s in stats)
        accepted = [a for s in stats for a in s.accepted]
        print(f"{name}: {rate:.1f} tokens/s, MAT {np.mean(accepted) + 1:.2f} over {len(accepted)} steps")


@pytest.mark.parametrize("drafter", ["prompt_lookup", "noisy_tree"])
def test_smollm2_tree_decoding_equals_greedy_generate(smollm2_runs: list[Run], drafter: str) -> None:
    for run in smollm2_runs:
        assert run.outputs[drafter][0] == run.ref, CHATS[smollm2_runs.index(run)]


def test_smollm2_correct_drafts_raise_mean_accepted_tokens(smollm2_runs: list[Run]) -> None:
    accepted = [a for run in smollm2_runs for a in run.outputs["noisy_tree"][1].accepted]
    assert np.mean(accepted) + 1 > 1.5  # 80% of drafted tokens are right: most steps accept some
    assert all(run.outputs["noisy_tree"][1].mat > 1 for run in smollm2_runs)


@torch.inference_mode()
def test_logits_processors_keep_greedy_output_equal_to_generate(
    tiny_llama: Callable[[str], LlamaForCausalLM],
) -> None:
    # A repetition penalty and banned repeated trigrams change which token is likeliest, and
    # differently at each node of a tree: each node's row must see its own root path.
    from transformers.generation.logits_process import (
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    model = tiny_llama("sdpa")
    prompt = [5, 17, 99, 5, 17, 42, 8, 5, 17]
    n = 40
    ref = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, repetition_penalty=1.5, no_repeat_ngram_size=3
    )[0, len(prompt) :].tolist()
    assert ref != greedy_continuation(model, prompt, n)  # the processors do change the output
    processors = [RepetitionPenaltyLogitsProcessor(1.5), NoRepeatNGramLogitsProcessor(3)]
    decoder = ReferenceDecoder(model)
    drafters: list[Drafter | None] = [None, _lookup, _noisy_drafter(len(prompt), ref, seed=5, vocab=128)]
    for drafter in drafters:
        out, stats = decoder.generate(prompt, n, drafter=drafter, logits_processor=processors)
        assert out == ref
    assert sum(stats.accepted) > 0  # the noisy drafter's true tokens were accepted under the processors


def test_a_tree_past_max_tree_is_cut_to_its_first_nodes(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    prompt, n = [3, 9, 27, 81], 12
    ref = greedy_continuation(model, prompt, n)

    def wide(ctx: np.ndarray) -> DraftTree:  # the true next token last among 300 wrong siblings
        done = ctx.size - len(prompt)
        wrong = [t for t in range(128) if t != ref[done]] * 3
        return _tree([*wrong[:300], ref[done]], [-1] * 301)

    out, stats = ReferenceDecoder(model, max_tree=64).generate(prompt, n, drafter=wide)
    assert (
        out == ref and stats.drafted == [64] * (n - 1) + [0] and sum(stats.accepted) == 0
    )  # the last step wants one token
    out, stats = ReferenceDecoder(model).generate(prompt, n, drafter=wide)  # 1,024 by default
    assert out == ref and stats.steps < n and set(stats.drafted[:-1]) == {301}
    with pytest.raises(ValueError, match="max_tree"):
        ReferenceDecoder(model, max_tree=-1)

"""Linear layers packed for the CPU: the same model, the same greedy output, trees verified on it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from decoder_client.cpu_linears import (
    DENSE,
    PACKED,
    PackedLinear,
    RowKernels,
    pack_linears,
    packable,
    row_kernels,
    tune_linears,
)
from decoder_client.forward_timing import SIZES
from decoder_client.models import load_model
from decoder_client.reference_decoder import ReferenceDecoder
from indexer.prompt_lookup import prompt_lookup
from indexer.tree_builder import DraftTree
from tests.client.conftest import greedy_continuation

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


def _linears(model: torch.nn.Module) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@needs_onednn
@torch.inference_mode()
def test_every_linear_is_packed_and_the_logits_stay(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    ids = torch.tensor([[5, 17, 99, 5, 17, 42, 8, 3, 77]])
    before = model(ids).logits
    linears = _linears(model)
    assert linears == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the output layer
    assert pack_linears(model) == linears
    assert _linears(model) == 0
    assert torch.allclose(model(ids).logits, before, atol=1e-5)
    assert pack_linears(model) == 0  # nothing left to pack


@torch.inference_mode()
def test_models_off_the_cpu_float32_path_are_left_alone(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa").to(torch.bfloat16)
    assert not packable(model)
    assert pack_linears(model) == 0 and _linears(model) == 2 * 7 + 1


@needs_onednn
@torch.inference_mode()
def test_packed_tiny_decoder_matches_packed_generate(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    prompt = [5, 17, 99, 5, 17, 42, 8]
    n = 40
    ref = greedy_continuation(model, prompt, n)
    pack_linears(model)
    packed = greedy_continuation(model, prompt, n)
    assert packed == ref
    out, stats = ReferenceDecoder(model).generate(prompt, n, drafter=_lookup)
    assert out == ref and stats.steps < n  # drafts were verified a few tokens at a time


# Dense from two rows to five, packed elsewhere: what tuning picked on a 2-core EPYC, and a table
# in which one step's forward and the next one's run on different kernels.
MIXED = {1: PACKED, 2: DENSE, 6: PACKED}


@needs_onednn
@torch.inference_mode()
@pytest.mark.parametrize("table", [MIXED, {1: DENSE}], ids=["mixed", "dense"])
def test_decoder_matches_generate_whichever_kernel_each_size_runs(
    tiny_llama: Callable[[str], LlamaForCausalLM], table: dict[int, str]
) -> None:
    model = tiny_llama("sdpa")
    prompt = [5, 17, 99, 5, 17, 42, 8]
    ref = greedy_continuation(model, prompt, 40)
    pack_linears(model)
    (kernels,) = row_kernels(model)
    kernels.set(table)
    assert greedy_continuation(model, prompt, 40) == ref
    out, stats = ReferenceDecoder(model).generate(prompt, 40, drafter=_lookup)
    assert out == ref and stats.steps < 40


def test_row_kernels_fill_sizes_in_between_and_refuse_bad_tables() -> None:
    kernels = RowKernels()
    assert [kernels.kernel(n) for n in (1, 3, 5000)] == [PACKED] * 3  # packed until told otherwise
    kernels.set({1: PACKED, 2: DENSE, 6: PACKED, 64: DENSE})
    kinds = [kernels.kernel(n) for n in (1, 2, 5, 6, 63, 64, 5000)]
    assert kinds == [PACKED, DENSE, DENSE, PACKED, PACKED, DENSE, DENSE]
    with pytest.raises(ValueError, match="starting at 1"):
        kernels.set({2: DENSE})  # what one row runs would be unsaid
    kernels.available.discard(DENSE)
    with pytest.raises(ValueError, match="not available"):
        kernels.set({1: DENSE})
    assert kernels.kernel(2) == DENSE  # a refused table changes nothing


@needs_onednn
@torch.inference_mode()
def test_tuning_keeps_the_logits_and_releases_the_kernel_no_size_takes(
    tiny_llama: Callable[[str], LlamaForCausalLM],
) -> None:
    model = tiny_llama("sdpa")
    ids = torch.tensor([[5, 17, 99, 5, 17, 42, 8, 3, 77]])
    before = model(ids).logits
    assert tune_linears(model) == {}  # nothing packed: nothing to tune
    pack_linears(model)
    table = tune_linears(model, context=16, repeats=1)
    assert sorted(table) == list(SIZES) and set(table.values()) <= {PACKED, DENSE}
    torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    kept = {PACKED: all(m.weight is not None for m in layers), DENSE: all(m.dense_weight is not None for m in layers)}
    assert kept == {k: k in table.values() for k in (PACKED, DENSE)}
    assert tune_linears(model) == table  # tuned once: the second call measures nothing


def _lookup(ctx: np.ndarray) -> DraftTree:
    return DraftTree.chain(prompt_lookup(ctx, num_tokens=8))


CHATS = ("Write a haiku about the sea.", "How do I reverse a list in Python? Show the code twice.")


@needs_onednn
@torch.inference_mode()
def test_smollm2_packed_decodes_as_the_dense_model(smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    dense, tokenizer = smollm2
    model = copy.deepcopy(dense)  # the session's model stays dense
    assert pack_linears(model) == 30 * 7 + 1
    (kernels,) = row_kernels(model)
    kernels.set(MIXED)  # steps of two to five tokens on the dense product, one token and six on packed
    eos = int(dense.generation_config.eos_token_id)
    decoder = ReferenceDecoder(model, tokenizer)
    for chat in CHATS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": chat}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt])
        ref = dense.generate(ids, do_sample=False, max_new_tokens=48, eos_token_id=eos, pad_token_id=eos)
        ref_tokens = ref[0, len(prompt) :].tolist()
        packed = model.generate(ids, do_sample=False, max_new_tokens=48, eos_token_id=eos, pad_token_id=eos)
        assert packed[0, len(prompt) :].tolist() == ref_tokens, chat
        out, _ = decoder.generate(prompt, 48, drafter=_lookup, eos_token_id=eos)
        assert out == ref_tokens, chat


@needs_onednn
def test_load_model_packs_on_the_cpu_unless_told_not_to(
    shared_data: Path, smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase]
) -> None:
    tokenizer = shared_data / "tokenizers" / "smollm2"
    packed, _ = load_model(None, tokenizer)
    dense, _ = load_model(None, tokenizer, pack=False)
    assert _linears(packed) == 0 and _linears(dense) == 30 * 7 + 1
    (kernels,) = row_kernels(packed)
    assert sorted(kernels.table()) == list(SIZES)  # tuned at load, every size timed
    ids = torch.tensor([smollm2[1]("Speculative decoding drafts tokens.")["input_ids"]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)

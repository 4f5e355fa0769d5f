"""A small llama.cpp model drafting beside the cache in the real engine: its chains are its own
greedy generation however the context moves, the engine's output is unchanged, and with the
service down it drafts where the client's fallback has nothing likelier. The only GGUF here is
SmolLM2-135M, so the draft model is the target itself: its chains are accepted (nearly) whole,
which checks that its KV cache follows the engine's steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.engines_llamacpp import greedy
from cache_service.host.embedded_redis import free_port
from decoder_client.client import ClientConfig, DraftClient
from decoder_client.draft_model import ModelDrafter
from decoder_client.engines.llamacpp import DraftcacheDraftModel
from decoder_client.engines.llamacpp_chains import LlamaChainModel
from indexer.drafter import DraftParams
from tests.engines.llamacpp.conftest import N_CTX, NAMESPACE, QUESTIONS, chat_ids

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[llamacpp]'")

K = 6


@pytest.fixture
def small_llama(gguf: Path) -> Iterator[Callable[..., Any]]:
    """``small_llama()``: a second engine on the GGUF, with no logits kept, as a draft model
    (with flash attention, as the target's engine: the same rounding, so its greedy chains are
    the target's)."""
    from llama_cpp import Llama

    made: list[Any] = []

    def make() -> Any:
        llm = Llama(model_path=str(gguf), n_ctx=N_CTX, n_threads=1, verbose=False, flash_attn=True)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


def test_its_chains_are_the_models_greedy_generation_as_the_context_moves(make_llama, small_llama) -> None:  # type: ignore[no-untyped-def]
    plain = make_llama()
    chains = LlamaChainModel(small_llama(), K)
    context = np.array(chat_ids(plain, QUESTIONS[2]), dtype=np.int32)
    for step in range(6):
        chain = chains.chain(context)
        assert chain.tolist() == greedy(plain, context.tolist(), K), step
        if step % 3 == 0:  # two of it accepted, then a sampled token: the two are not read again
            before = chains.fed
            context = np.array([*context, *chain[:2], 17], dtype=np.int32)
            assert chains.first(context) is not None and chains.fed - before == 1
            chains.extend()
        elif step % 3 == 1:  # cut back below what its cache held
            context = context[:-3]
        else:  # another request
            context = np.array(chat_ids(plain, QUESTIONS[0]), dtype=np.int32)
    assert chains.first(np.arange(N_CTX - K + 1, dtype=np.int32)) is None  # no room for a chain


def test_beside_a_cache_that_is_down_it_drafts_and_the_output_is_unchanged(make_llama, small_llama) -> None:  # type: ignore[no-untyped-def]
    # No service listens: the client's fallback (prompt lookup over the request, its chances
    # calibrated) drafts where it finds something likelier than the model's own next token.
    config = ClientConfig(target=f"127.0.0.1:{free_port()}", namespace=NAMESPACE, params=DraftParams(chain=K))
    draft = DraftcacheDraftModel(DraftClient(config), num_pred_tokens=K, chain_model=LlamaChainModel(small_llama(), K))
    llm = draft.attach(make_llama(draft))
    plain = make_llama()
    for question in QUESTIONS:
        ids = chat_ids(llm, question)
        out = greedy(llm, ids, 48)
        # Plain greedy's tokens: the engines compute attention with flash attention, so a
        # batched verification rounds as a one-token step does.
        assert len(out) > 0 and out == greedy(plain, ids, 48), question
    stats = draft.stats
    assert draft.client.stats.fallback > 0 and draft.client.stats.remote == 0
    assert 0 < stats.model_steps <= stats.steps
    # The target drafting for itself, both engines rounding alike: its chains are accepted whole.
    assert stats.model_accepted == stats.model_proposed > 0
    assert stats.mean_accepted_tokens > 4.0
    # Only the cache's proposals reach the outcomes that correct its chances.
    assert draft.outcomes.summary()["proposed_tokens"] == stats.proposed - stats.model_proposed
    # Each generation's steps, counted as it ended: what the model's read of a prompt serves.
    assert draft.request_steps.count == len(QUESTIONS)
    assert draft.request_steps.remaining(0) == pytest.approx(stats.calls / len(QUESTIONS))
    draft.close()


def test_a_chain_model_that_cannot_read_the_engines_ids_is_refused(make_llama) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128)
    )
    config = ClientConfig(target=f"127.0.0.1:{free_port()}", namespace=NAMESPACE, params=DraftParams(chain=K))
    draft = DraftcacheDraftModel(DraftClient(config), num_pred_tokens=K, chain_model=ModelDrafter(tiny, K))
    with pytest.raises(ValueError, match="the chain model reads 128 ids; this Llama's vocabulary has 49152"):
        draft.attach(make_llama(draft))
    draft.close()

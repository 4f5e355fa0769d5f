"""The Hugging Face folder made from the SmolLM2 GGUF: a plain model equal to the GGUF one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from decoder_client.models import MODEL_CACHE_ENV, SMOLLM2_HF, model_cache_dir, smollm2_hf_folder


def test_folder_is_the_gguf_model_dequantized_and_made_once(
    tmp_path: Path, smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase]
) -> None:
    gguf_model, shared_tokenizer = smollm2
    folder = smollm2_hf_folder(tmp_path)
    assert folder == tmp_path / SMOLLM2_HF
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model: engines load it as such
    assert [p.name for p in tmp_path.iterdir()] == [SMOLLM2_HF]  # no staging folder left behind

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "Speculative decoding drafts tokens that the target model verifies."
    ids = tokenizer(text)["input_ids"]
    assert ids == shared_tokenizer(text)["input_ids"]  # the same vocabulary as the namespace's
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits
        theirs = gguf_model(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs)  # the same weights, not merely the same shapes

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert smollm2_hf_folder(tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # made once, then reused


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "models"))
    assert model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv(MODEL_CACHE_ENV)
    assert model_cache_dir() == Path(__file__).resolve().parents[2] / ".cache"  # the checkout's

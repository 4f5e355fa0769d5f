"""Replay's cut off the trace with the real draft model (SmolLM2 in llama.cpp): on answers in
SmolLM2's own ids, and behind Llama-2's tokenizer on a Spec-Bench answer, the cut replay accepts
exactly what the whole one does, for a fraction of the model's reads."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from benchmarks.draft_model_replay import LiveDraftModel
from benchmarks.replay import ReplayStats, replay
from benchmarks.trace_cut import SkipsOffTrace, TraceCut
from benchmarks.traces import Conversation, read_traces
from decoder_client.chain_model import ChainModel
from decoder_client.engines.llamacpp_chains import LlamaChainModel
from decoder_client.retokenized import Retokenized

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[llamacpp]'")

K = 8
TOPK_TRACE = Path(__file__).parents[3] / "benchmarks/data/spec_bench_smollm2_topk.jsonl.gz"


@pytest.fixture
def chain_model(gguf: Path) -> Iterator[Any]:
    """``chain_model(k)``: SmolLM2 in a llama.cpp engine of its own, drafting chains of ``k``."""
    from llama_cpp import Llama

    made: list[Any] = []

    def make(k: int) -> LlamaChainModel:
        llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=1, verbose=False)
        made.append(llm)
        return LlamaChainModel(llm, k)

    yield make
    for llm in made:
        llm.close()


def _first_answer(conv: Conversation, tokens: int) -> Conversation:
    """The conversation's first prompt and the first ``tokens`` of its answer."""
    prompt, answer = conv.segments[:2]
    return replace(conv, segments=(prompt, replace(answer, tokens=answer.tokens[:tokens], topk=None)))


def _both(convs: list[Conversation], whole: Any, cut: Any) -> tuple[ReplayStats, ReplayStats]:
    return replay(convs, LiveDraftModel(whole, K)), replay(convs, LiveDraftModel(cut, K))


def test_in_the_models_own_ids_the_cut_accepts_exactly_the_same(chain_model: Any) -> None:
    convs = [_first_answer(c, 100) for c in read_traces(TOPK_TRACE, limit=1)]
    whole: ChainModel = chain_model(K)
    skips = SkipsOffTrace(chain_model(K))
    full, cut = _both(convs, whole, TraceCut(skips, skips))
    assert (cut.mat, cut.steps, cut.drafted) == (full.mat, full.steps, full.drafted)
    assert full.mat > 2  # SmolLM2 drafting for its own answers, quantized: long chains, some cut
    assert skips.skipped > 0 and skips.forwards - skips.skipped < whole.forwards


def test_behind_another_tokenizer_the_cut_accepts_the_same(chain_model: Any, shared_data: Path) -> None:
    folder = shared_data / "tokenizers"
    llama, smol = (AutoTokenizer.from_pretrained(folder / name) for name in ("llama2-spm", "smollm2"))
    conv = _first_answer(read_traces(shared_data / "traces/spec_bench_vicuna7b.jsonl.gz", limit=1)[0], 100)
    skips = SkipsOffTrace(chain_model(K + 1))
    whole = Retokenized(chain_model(K + 1), llama, smol, K)
    full, cut = _both([conv], whole, TraceCut(Retokenized(skips, llama, smol, K), skips))
    # The model reads on to the end of the word that leaves the trace, so the target's ids up to
    # the wrong one, and so what is accepted, are the whole chains'.
    assert (cut.mat, cut.steps) == (full.mat, full.steps) and full.mat > 1.5
    assert skips.skipped > 0 and skips.forwards - skips.skipped < 0.7 * whole.inner.forwards

"""Replays of the real traces: the harness reproduces prompt lookup's known figure, and the
engine clearly beats it. The full-trace targets run with ``-m slow``."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.baselines import (
    EngineDrafter,
    PromptLookupDrafter,
    RestDrafter,
    SuffixDecodingDrafter,
    rest_available,
    suffix_decoding_available,
)
from benchmarks.replay import replay
from benchmarks.replay_bench import SUFFIX_FACTOR, build_rest_datastore
from benchmarks.traces import read_traces
from cache_service.admin import warm
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.prior import PriorConfig
from indexer.tokens import Namespace

SPEC = "traces/spec_bench_vicuna7b.jsonl.gz"
SWE = "traces/swe_agent_dev.jsonl.gz"


def _engine(vocab: int, name: str, prior=None) -> EngineDrafter:
    return EngineDrafter(
        NamespaceDrafter(Namespace(name=name, vocab_size=vocab), DrafterConfig(), prior=prior), DraftParams()
    )


def test_prompt_lookup_harness_check(shared_data: Path) -> None:
    # Published: a faithful prompt-lookup replay of this file gives about 1.78 tokens per step.
    stats = replay(read_traces(shared_data / SPEC), PromptLookupDrafter())
    assert 1.76 <= stats.mat <= 1.81
    assert stats.tokens == 91_881  # every recorded output token was replayed once


def test_engine_beats_prompt_lookup_cold(shared_data: Path) -> None:
    convs = read_traces(shared_data / SPEC, limit=80)
    ours = replay(convs, _engine(32_000, "llama2"))
    pld = replay(convs, PromptLookupDrafter())
    # No prior, empty lifetime: own context + session tiers + the growing lifetime buffer alone.
    assert ours.mat > 1.2 * pld.mat
    assert ours.tokens == pld.tokens


def _prior(shared_data: Path, tokenizer: str):
    encode, vocab = warm.load_tokenizer(shared_data / "tokenizers" / tokenizer)
    docs = warm.read_corpus(shared_data / "corpora" / "sharegpt_v3_17671.json.gz", "sharegpt")
    return warm.build_prior(warm.tokenize_corpus(docs, encode, vocab), PriorConfig()), vocab


@pytest.mark.slow
def test_spec_bench_target_with_sharegpt_prior(shared_data: Path) -> None:
    prior, vocab = _prior(shared_data, "llama2-spm")
    stats = replay(read_traces(shared_data / SPEC), _engine(vocab, "llama2", prior))
    assert stats.mat >= 2.3  # the target at budget 64, cold start, ShareGPT prior


@pytest.mark.slow
@pytest.mark.skipif(not rest_available(), reason="draftretriever not installed")
def test_spec_bench_beats_rest_from_the_same_corpus(shared_data: Path, tmp_path: Path) -> None:
    tokenizer = shared_data / "tokenizers" / "llama2-spm"
    corpus = shared_data / "corpora" / "sharegpt_v3_17671.json.gz"
    store = tmp_path / "rest.idx"
    assert build_rest_datastore(corpus, "sharegpt", tokenizer, store) > 20_000_000
    convs = read_traces(shared_data / SPEC)
    rest = RestDrafter(str(store), choices=64)
    try:
        theirs = replay(convs, rest)
    finally:
        rest.close()
    prior, vocab = _prior(shared_data, "llama2-spm")
    ours = replay(convs, _engine(vocab, "llama2", prior))
    assert 1.6 <= theirs.mat <= 2.1  # published REST on this file: 1.63-1.82 (its search is randomized)
    assert ours.mat > 1.2 * theirs.mat


@pytest.mark.slow
@pytest.mark.skipif(not suffix_decoding_available(), reason="arctic-inference not installed")
def test_swe_agent_beats_suffix_decoding(shared_data: Path) -> None:
    convs = read_traces(shared_data / SWE)
    ours = replay(convs, _engine(49_152, "smollm2"))
    best = SUFFIX_FACTOR["trees"]  # its best setting on these traces
    theirs = replay(convs, SuffixDecodingDrafter(max_spec_tokens=64, max_spec_factor=best, min_token_prob=0.01))
    assert ours.mat > theirs.mat

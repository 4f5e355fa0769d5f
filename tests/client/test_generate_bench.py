"""``draftcache bench-generate``: prompts from the real traces, the report, and a tiny real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.generate_bench import (
    AGENTIC,
    BESIDE,
    LOOKUP,
    MODEL,
    OURS,
    VANILLA,
    BenchConfig,
    Measured,
    Outcome,
    Prompt,
    agentic_prompts,
    bench,
    chatml_turns,
    encode,
    pick,
    report,
    spec_bench_prompts,
    summarize,
    vicuna_question,
)


def _measured(category: str, seconds: tuple[float, float, float], *, differ: bool = False) -> Measured:
    tokens = [1, 2, 3, 4]
    runs = {
        VANILLA: Outcome(tokens, seconds[0]),
        LOOKUP: Outcome(tokens, seconds[1]),
        OURS: Outcome([9, 9, 9, 9] if differ else tokens, seconds[2], steps=2),
    }
    return Measured(Prompt(category, f"{category}/{seconds}", (("user", "q"),)), 10, runs)


def test_prompt_helpers() -> None:
    assert vicuna_question("A chat. USER: Translate: Hallo ASSISTANT:") == "Translate: Hallo"
    with pytest.raises(ValueError):
        vicuna_question("no template here")
    # Held-out picks never overlap the measured ones.
    assert set(pick(list(range(20)), 4)).isdisjoint(pick(list(range(20)), 4, held_out=True))
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU\nV<|im_end|>\n<|im_start|>assistant\n"
    assert chatml_turns(text) == [("system", "S"), ("user", "U\nV")]


def test_summary_ratios_medians_and_losslessness() -> None:
    results = [
        _measured("qa", (2.0, 2.0, 1.0)),  # ours twice as fast
        _measured("qa", (1.0, 2.0, 1.0)),
        _measured(AGENTIC, (4.0, 2.0, 1.0), differ=True),
    ]
    summary = summarize(results)
    assert list(summary) == ["qa", "spec_bench", AGENTIC]  # groups, Spec-Bench overall, agentic last
    qa = summary["qa"]
    assert qa["tokens_per_s"] == {VANILLA: 2.67, LOOKUP: 2.0, OURS: 4.0}  # 8 tokens in 3, 4 and 2 s
    assert qa["ratio"] == {LOOKUP: 0.75, OURS: 1.5}  # total vanilla time / total time
    assert qa["median_ratio"] == {LOOKUP: 0.75, OURS: 1.5}  # medians of (1.0, 0.5) and (2.0, 1.0)
    assert qa["mat"] == 2.0 and qa["lossless"]
    assert not summary[AGENTIC]["lossless"]


def test_report_flags_differing_outputs() -> None:
    results = [_measured("qa", (2.0, 2.0, 1.0)), _measured("rag", (1.0, 1.0, 1.0), differ=True)]
    result = {
        "summary": summarize(results),
        "lossless": False,
        "differing": ["rag/x"],
        "prompt_lookup_num_tokens": {"spec_bench": 3},
        "cost_curve_ms": {1: 60.0},
        "linear_kernels": {1: "packed", 2: "dense"},
        "accepted_by_tier": {},
        "prior": False,
    }
    text = report(result)
    assert "OUTPUTS DIFFER on rag/x" in text
    assert "qa" in text and "spec_bench" in text
    assert "linear kernels by forward size {1: 'packed', 2: 'dense'}" in text


def test_prompts_from_the_real_traces(shared_data: Path, smollm2) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer = smollm2
    spec = spec_bench_prompts(
        shared_data / "traces/spec_bench_vicuna7b.jsonl.gz", shared_data / "tokenizers/llama2-spm", 2
    )
    # Six Spec-Bench groups (MT-bench's eight categories form one), two each, as plain questions.
    assert len(spec) == 12 and len({p.category for p in spec}) == 6
    assert all("USER:" not in p.messages[0][1] for p in spec)
    agentic = agentic_prompts(shared_data / "traces/swe_agent_dev.jsonl.gz", tokenizer, 2, 3, 64)
    # Two tasks asked three times in rounds, each repeat a small variation of the same turn.
    assert [p.name.split("#")[1] for p in agentic] == ["1", "1", "2", "2", "3", "3"]
    first, again = agentic[0], agentic[2]
    assert first.messages[0] == again.messages[0] and first.messages[1] != again.messages[1]
    assert len(tokenizer.encode(first.messages[1][1], add_special_tokens=False)) <= 64 + 8


def test_tiny_run_is_lossless(bench_paths: dict[str, Path], smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    config = BenchConfig(
        **bench_paths,
        max_new_tokens=12,
        pld_candidates=(3,),
        tuning_tokens=4,
        curve_context=32,
        curve_repeats=1,
    )
    repeat = Prompt("qa", "echo", (("user", "Repeat exactly: alpha beta gamma delta alpha beta gamma delta"),))
    other = Prompt("translation", "de", (("user", "Translate German to English: Guten Morgen"),))
    prompts = [(p, encode(tokenizer, p)) for p in (repeat, other)]
    result = bench(model, tokenizer, prompts, prompts[:1], config)
    # The same tokens from greedy, transformers' prompt lookup and draftcache on every prompt.
    assert result["lossless"] and result["differing"] == []
    assert list(result["summary"]) == ["qa", "translation", "spec_bench"]
    row = result["summary"]["spec_bench"]
    assert row["prompts"] == 2 and row["tokens"] > 0 and row["mat"] >= 1.0
    assert set(row["tokens_per_s"]) == {VANILLA, LOOKUP, OURS} and set(row["ratio"]) == {LOOKUP, OURS}
    assert result["prompt_lookup_num_tokens"] == {"spec_bench": 3}
    assert [d["name"] for d in result["prompts"]] == ["echo", "de"] and all(d["identical"] for d in result["prompts"])


def test_the_topk_feed_is_one_of_the_known_places(bench_paths: dict[str, Path]) -> None:
    for place in ("tree", "path", "none"):
        assert BenchConfig(**bench_paths, topk_at=place).topk_at == place
    with pytest.raises(ValueError, match="topk_at must be one of tree, path, none"):
        BenchConfig(**bench_paths, topk_at="everywhere")


def test_a_round_that_is_not_the_last_leaves_the_engine_as_it_was(smollm2) -> None:  # type: ignore[no-untyped-def]
    # Each prompt is decoded in rounds and the fastest counts: a round before the last must not
    # teach the engine its own answer, or the next round drafts the text it is about to write.
    # The target's top-k at every verified node (the successor tier) and the calibrators'
    # lessons are such teaching as much as a commit is.
    from benchmarks.generate_bench import SharedEngine
    from decoder_client.cost_model import CostCurve
    from indexer.drafter import DraftParams

    model, tokenizer = smollm2
    curve = CostCurve((1, 2, 4, 8, 64), (0.060, 0.070, 0.079, 0.088, 0.206))
    ours = SharedEngine(model, int(model.config.vocab_size), DraftParams(budget=64), curve, None, "tree")
    ids = encode(tokenizer, Prompt("writing", "w", (("user", "Write a short poem about the sea."),)))
    eos = tokenizer.eos_token_id
    rounds = [ours(ids, 24, eos, last=False), ours(ids, 24, eos, last=False), ours(ids, 24, eos, last=True)]
    assert rounds[0].tokens == rounds[1].tokens == rounds[2].tokens
    # Every round drafts from the same state, so takes the same steps.
    assert rounds[0].steps == rounds[1].steps == rounds[2].steps
    assert ours.engine.successors.size > 0  # the last round's lessons are kept


def test_a_draft_model_alone_and_beside_ours_stays_lossless(bench_paths: dict[str, Path], smollm2) -> None:  # type: ignore[no-untyped-def]
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from decoder_client.engines.llamacpp_chains import LlamaChainModel
    from decoder_client.models import GGUF_FILE, smollm2_dir

    model, tokenizer = smollm2
    folder = smollm2_dir()
    assert folder is not None  # the fixture skips without it

    def quantized_copy() -> LlamaChainModel:  # the target's own weights in 4 bits: mostly right
        return LlamaChainModel(llama_cpp.Llama(model_path=str(folder / GGUF_FILE), n_ctx=2048, verbose=False), 4)

    config = BenchConfig(
        **bench_paths, max_new_tokens=24, pld_candidates=(3,), tuning_tokens=4, curve_context=32, curve_repeats=1
    )
    prompts = [(p, encode(tokenizer, p)) for p in [Prompt("qa", "sky", (("user", "Why is the sky blue?"),))]]

    class Small:  # a model of another, smaller vocabulary: refused before anything is measured
        k, vocab_size = 4, 1000

    with pytest.raises(ValueError, match="the draft model reads 1000 ids"):
        bench(model, tokenizer, prompts, prompts, config, draft_models=(Small(), Small()))  # type: ignore[arg-type]
    result = bench(model, tokenizer, prompts, prompts, config, draft_models=(quantized_copy(), quantized_copy()))
    assert result["lossless"]
    row = result["summary"]["qa"]
    assert set(row["tokens_per_s"]) == {VANILLA, LOOKUP, OURS, MODEL, BESIDE}
    assert row["mat_by_method"][MODEL] > 2.0 and row["mat_by_method"][BESIDE] > 2.0
    assert "draftcache+model" in report(result)

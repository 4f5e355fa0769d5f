"""``draftcache bench-topk``: the three feeds of the target's top-k, on the real model."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.generate_bench import BenchConfig, Prompt
from benchmarks.topk_bench import bench_topk, report


def test_a_tiny_run_compares_the_feeds_on_the_same_outputs(bench_paths: dict[str, Path], smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    config = BenchConfig(**bench_paths, max_new_tokens=16, budget=16)
    prompts = [
        Prompt("qa", "echo", (("user", "Repeat exactly: alpha beta gamma delta alpha beta gamma delta"),)),
        Prompt("agentic", "echo#2", (("user", "Repeat exactly: alpha beta gamma delta alpha beta gamma delta"),)),
    ]
    result = bench_topk(model, tokenizer, prompts, config)
    # Greedy decoding: every feed gives the same tokens, so the MATs compare like for like.
    assert result["identical"] and result["prompts"] == 2
    assert set(result["mat"]) == {"tree", "path", "none"} and set(result["tokens"]) == {"spec_bench", "agentic", "all"}
    assert result["ratio_to_none"]["none"] == {"spec_bench": 1.0, "agentic": 1.0, "all": 1.0}
    assert all(m >= 1.0 for feed in result["mat"].values() for m in feed.values())
    assert "outputs identical: True" in report(result)


def test_chains_are_verified_as_engines_take_them(bench_paths: dict[str, Path], smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    config = BenchConfig(**bench_paths, max_new_tokens=16, budget=16)
    prompts = [Prompt("qa", "echo", (("user", "Repeat exactly: one two three four one two three four"),))]
    result = bench_topk(model, tokenizer, prompts, config, chain=2)
    assert result["identical"] and result["chain"] == 2
    # A chain of 2 and the target's own token: never more than 3 tokens a step.
    assert all(1.0 <= m <= 3.0 for feed in result["mat"].values() for m in feed.values())
    assert "chains of at most 2" in report(result)


def test_drafting_ahead_counts_its_hits_and_leaves_the_outputs_alone(bench_paths: dict[str, Path], smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    config = BenchConfig(**bench_paths, max_new_tokens=24, budget=16)
    text = "Repeat exactly: red green blue red green blue red green blue red green blue"
    prompts = [Prompt("qa", "echo", (("user", text),)), Prompt("agentic", "echo#2", (("user", text),))]
    plain = bench_topk(model, tokenizer, prompts, config)
    ahead = bench_topk(model, tokenizer, prompts, config, lookahead=4)
    assert ahead["identical"] and plain["prespeculation_hit_rate"] == {"tree": None, "path": None, "none": None}
    rates = ahead["prespeculation_hit_rate"]
    # An echo: the tree is taken whole most steps, an outcome drafted ahead for.
    assert all(0.0 < rate <= 1.0 for rate in rates.values())
    assert "pre-speculation (4 outcomes ahead), hit rate" in report(ahead)
    with pytest.raises(ValueError, match="lookahead must be in"):
        bench_topk(model, tokenizer, prompts, config, lookahead=17)

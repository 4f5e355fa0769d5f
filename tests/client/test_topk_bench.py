"""``draftcache bench-topk``: the three feeds of the target's top-k, on the real model."""

from __future__ import annotations

from pathlib import Path

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

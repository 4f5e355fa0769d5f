"""``draftcache generate``'s core on the real model: draftcache's output equals greedy decoding."""

from __future__ import annotations

from benchmarks.generate import InProcessDrafter, run_generate
from indexer.drafter import DraftParams

PROMPT = "Repeat exactly: alpha beta gamma delta. Then repeat it again: alpha beta gamma delta."


def test_generate_is_lossless_and_counts_tiers(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    drafter = InProcessDrafter(len(tokenizer), DraftParams(budget=16))
    # Whole trees verified: what is accepted does not hang on this machine's timings.
    result = run_generate(model, tokenizer, PROMPT, drafter, max_new_tokens=24, cost_aware=False)
    # Same tokens from vanilla greedy, transformers' prompt lookup and draftcache's tree decoder.
    assert result["identical"]
    ours = result["draftcache"]
    # The answer repeats the prompt's phrase: drafts from the request's own context are accepted.
    assert ours["mat"] > 1.0
    accepted = round(len(ours["tokens"]) - len(ours["tokens"]) / ours["mat"])  # tokens minus steps
    # Accepted draft tokens are attributed to tiers (all but the last step's, seen by no later call).
    assert 0 < sum(ours["accepted_by_tier"].values()) <= accepted


def test_generate_with_trees_cut_by_measured_cost_is_lossless(smollm2) -> None:  # type: ignore[no-untyped-def]
    # Cost-aware verification cuts each tree to the prefix worth verifying on this device (a
    # measured, machine-dependent curve): however much is cut, the output is greedy's.
    model, tokenizer = smollm2
    drafter = InProcessDrafter(len(tokenizer), DraftParams(budget=16))
    result = run_generate(model, tokenizer, PROMPT, drafter, max_new_tokens=24, cost_aware=True)
    assert result["identical"]
    assert result["draftcache"]["mat"] >= 1.0

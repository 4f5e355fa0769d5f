"""draftcache beside a draft model inside real vLLM: the proposer runs a small model in vLLM's
worker (here SmolLM2 drafting for itself, the only model this project installs: the mechanics,
not the gain), its chains go where more of them is expected to be accepted than of the cache's,
vLLM's outputs stay plain greedy's, and every request is still committed to the service."""

from __future__ import annotations

from pathlib import Path

from tests.engines.vllm.conftest import (
    NAMESPACE,
    assert_committed_once,
    drafting_kwargs,
    generate,
    make_llm,
    shutdown,
    spec_counters,
    wait_stats,
)
from tests.faults import Serve

MODEL_NAMESPACE = NAMESPACE + "-beside"  # its own lifetime log, so the commits counted are this test's


def test_a_draft_model_drafts_beside_the_cache_in_vllms_worker(
    model_folder: Path, serve: Serve, chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    copy, code, planets, _ = chat_prompts
    batch = [(copy, 48), (code, 64), (planets, 40)]
    llm = make_llm(model_folder)
    try:
        plain = generate(llm, batch)
    finally:
        shutdown(llm)
    stats_path = tmp_path / "stats.json"
    kwargs = drafting_kwargs(serve, stats_path, namespace=MODEL_NAMESPACE, draft_model=str(model_folder))
    llm = make_llm(model_folder, **kwargs)
    try:
        before = spec_counters(llm)
        assert generate(llm, batch) == plain
        after = spec_counters(llm)
    finally:
        shutdown(llm)
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
    stats = wait_stats(stats_path, lambda s: s["sessions_closed"] == len(batch), 30, "every request closed")
    print(f"vLLM drafted {drafted:.0f}, accepted {accepted:.0f}; proposer {stats}")
    assert stats["errors"] == 0 and stats["commits_dropped"] == 0, stats
    # The model drafting for itself: its chains go on most steps and vLLM keeps nearly all of
    # them (the same weights in float32; vLLM's kernels and transformers' may part on a near tie).
    assert stats["model_steps"] >= stats["steps"] / 2, stats
    assert stats["model_accepted"] >= 0.9 * stats["model_proposed"] > 0, stats
    assert accepted >= 0.8 * drafted > 0, (drafted, accepted)  # vLLM's own counters say the same
    assert stats["model_rows_live"] == 0, stats  # every request gave its model back
    assert stats["model_reads"] < stats["model_forwards"], stats  # the batch's rows read together
    assert_committed_once(serve, MODEL_NAMESPACE, batch, plain)

"""draftcache beside a draft model inside real vLLM: the proposer runs a small model in vLLM's
worker (here SmolLM2 drafting for itself, the only model this project installs: the mechanics,
not the gain), its chains go where more of them is expected to be accepted than of the cache's,
vLLM's outputs stay plain greedy's, and every request is still committed to the service. With
the engine's steps timed, a model that costs what its target does cannot pay for its reads, and
stops reading."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.vllm.conftest import (
    NAMESPACE,
    K,
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


Batch = list[tuple[list[int], int]]


@pytest.fixture(scope="module")
def batch(chat_prompts: list[list[int]]) -> Batch:
    copy, code, planets, _ = chat_prompts
    return [(copy, 48), (code, 64), (planets, 40)]


@pytest.fixture(scope="module")
def later(model_folder: Path) -> Batch:
    """A request after the batch, of text it does not hold."""
    from transformers import AutoTokenizer

    chat = [{"role": "user", "content": "Name eight animals, and one fact about each."}]
    ids = AutoTokenizer.from_pretrained(model_folder).apply_chat_template(
        chat, add_generation_prompt=True, return_dict=True
    )
    return [(list(ids["input_ids"]), 96)]


@pytest.fixture(scope="module")
def plain(model_folder: Path, batch: Batch, later: Batch) -> tuple[list[list[int]], list[list[int]]]:
    """Plain greedy's outputs for the batch and for the later request."""
    llm = make_llm(model_folder)
    try:
        return generate(llm, batch), generate(llm, later)
    finally:
        shutdown(llm)


def test_a_draft_model_drafts_beside_the_cache_in_vllms_worker(
    model_folder: Path, serve: Serve, batch: Batch, plain: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    stats_path = tmp_path / "stats.json"
    # A configured cost times nothing: the rule weighs expected tokens alone, and the model's
    # chains, right more often than their probabilities say, go.
    kwargs = drafting_kwargs(
        serve, stats_path, namespace=MODEL_NAMESPACE, draft_model=str(model_folder), token_cost=0.1
    )
    llm = make_llm(model_folder, **kwargs)
    try:
        before = spec_counters(llm)
        assert generate(llm, batch) == plain[0]
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
    assert stats["model_waited"] == stats["model_skipped"] == 0, stats  # a configured cost prices no read
    assert_committed_once(serve, MODEL_NAMESPACE, batch, plain[0])


def test_a_draft_model_as_dear_as_its_target_stops_reading_in_vllms_worker(
    model_folder: Path,
    serve: Serve,
    batch: Batch,
    later: Batch,
    plain: tuple[list[list[int]], list[list[int]]],
    tmp_path: Path,
) -> None:
    # The steps timed (the default): a read of the model costs what a step of the target does,
    # so a chain of its, even right throughout, brings less a second than the cache's draft for
    # no reads at all. The batch times the engine's steps and the model's reads; the request
    # after it is drafted from the cache alone, its model read only where 64 steps priced out
    # have it read once more, to be timed again (decoder_client.engines.read_retry).
    stats_path = tmp_path / "stats.json"
    kwargs = drafting_kwargs(serve, stats_path, namespace=MODEL_NAMESPACE + "-dear", draft_model=str(model_folder))
    llm = make_llm(model_folder, **kwargs)
    try:
        assert generate(llm, batch) == plain[0]
        first = wait_stats(stats_path, lambda s: s["sessions_closed"] == len(batch), 30, "the batch closed")
        assert generate(llm, later) == plain[1]
    finally:
        shutdown(llm)
    stats = wait_stats(stats_path, lambda s: s["sessions_closed"] == len(batch) + 1, 30, "every request closed")
    print(f"proposer {stats}")
    assert stats["errors"] == 0 and stats["commits_dropped"] == 0, stats
    rows, skipped, forwards = (stats[k] - first[k] for k in ("rows", "model_skipped", "model_forwards"))
    assert first["model_forwards"] > 0 and rows > 8, (first, stats)  # it read the batch's steps at first
    # ... once the engine's first steps were timed: the batch's prompts waited for their price.
    assert first["model_waited"] >= len(batch), first
    retried = stats["model_retried"] - first["model_retried"]
    assert stats["model_retried"] <= 2 and skipped + retried >= rows - 2, (first, stats)
    assert forwards <= 2 + K * retried, (first, stats)  # a retried row reads, and extends its chain

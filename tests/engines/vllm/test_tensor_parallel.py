"""draftcache inside real vLLM split over tensor-parallel ranks: vLLM builds a proposer on every
rank of its last pipeline stage and reads the drafts of the first; the others stand by, so each
request is drafted by one proposer and reaches the service's lifetime log once, not once per
rank, and greedy outputs are those of plain vLLM on the same ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

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

TP_NAMESPACE = NAMESPACE + "-tp"  # this module's commits only
# SmolLM2-135M has 9 attention heads and 3 key/value heads: 3 ranks. On a 2-core host two of
# them share a core (vLLM's CPU workers bind one core each by default and would find too few).
TP = 3
BIND = "0|1|0"


def test_one_rank_drafts_and_each_request_is_committed_once(
    model_folder: Path, serve: Serve, chat_prompts: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", BIND)  # the engine's worker processes inherit it
    copy, _, planets, capital = chat_prompts
    batch = [(copy, 48), (planets, 32), (capital, 8)]
    # Plain vLLM on the same ranks: a sum over three ranks may round unlike one rank's.
    llm = make_llm(model_folder, tensor_parallel_size=TP)
    try:
        plain = generate(llm, batch)
    finally:
        shutdown(llm)
    stats_path = tmp_path / "stats.json"  # written by the drafting rank alone
    # Three ranks on two cores: a step now and then stalls for seconds. A stall longer than
    # idle_close_s closes the requests and reopens them (by design), so it is set well above one.
    settings = drafting_kwargs(serve, stats_path, namespace=TP_NAMESPACE, idle_close_s=10.0)
    llm = make_llm(model_folder, tensor_parallel_size=TP, **settings)
    try:
        assert generate(llm, batch) == plain
        counters = spec_counters(llm)
        stats = wait_stats(stats_path, lambda s: s["sessions_closed"] >= len(batch), 40, "every request closed")
    finally:
        shutdown(llm)
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0  # the drafting rank's drafts were read
    assert "standby" not in stats and stats["sessions_opened"] == len(batch) and stats["errors"] == 0
    assert_committed_once(serve, TP_NAMESPACE, batch, plain)

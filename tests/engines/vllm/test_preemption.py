"""Preemption in real vLLM with draftcache as its proposer (drafting near, the default): with a
KV cache too small for the batch, vLLM preempts requests (they leave the batch) and resumes
them later (they come back with their whole history). Outputs stay plain greedy's, a request
that comes back is a new session, and each request's whole sequence reaches the lifetime log.

Slow (its own two engines): ``-m slow``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.vllm.conftest import (
    NAMESPACE,
    drafting_kwargs,
    generate,
    make_llm,
    shutdown,
    wait_stats,
)
from tests.faults import Serve, log_entries, wait_for

pytestmark = pytest.mark.slow

KV_BYTES = 32 << 20  # SmolLM2 in float32: 640 tokens of KV cache, under half of what the batch needs


def test_preempted_requests_come_back_as_new_sessions(
    model_folder: Path, serve: Serve, chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    requests = [(p, 200) for p in chat_prompts] + [(p, 180) for p in chat_prompts[:2]]  # 1,400 tokens
    plain = make_llm(model_folder, kv_cache_memory_bytes=KV_BYTES)
    try:
        expected = generate(plain, requests, ignore_eos=True)
    finally:
        shutdown(plain)
    stats_path = tmp_path / "stats.json"
    llm = make_llm(model_folder, kv_cache_memory_bytes=KV_BYTES, **drafting_kwargs(serve, stats_path))
    try:
        before = len(log_entries(serve.redis_url(), NAMESPACE))
        assert generate(llm, requests, ignore_eos=True) == expected
        stats = wait_stats(stats_path, lambda s: s["sessions_live"] == 0, 30, "the sessions to close")
        print(stats)
        # More sessions than requests: preempted ones left the batch and came back.
        assert stats["sessions_opened"] > len(requests) and stats["errors"] == 0
        wait_for(
            lambda: len(log_entries(serve.redis_url(), NAMESPACE)) - before >= stats["sessions_closed"], 30, "commits"
        )
        committed = log_entries(serve.redis_url(), NAMESPACE)[before:]
        for (prompt, _), out in zip(requests, expected, strict=True):
            whole = prompt + out
            assert any(e[: len(whole)] == whole for e in committed), "a request's whole sequence was not committed"
    finally:
        shutdown(llm)

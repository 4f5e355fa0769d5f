"""Recording the engine's greedy outputs for an offline replay of its proposer
(benchmarks/proposer_replay.py), with the real engine on SmolLM2."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks import engine_workloads as ew
from benchmarks.engines_llamacpp import PromptCache, greedy
from benchmarks.proposer_replay import load_outputs, record
from tests.engines.llamacpp.conftest import QUESTIONS, chat_ids


def test_every_request_is_decoded_in_order_as_the_benchmarks_plain_engine_decodes_it(
    tmp_path: Path, make_llama
) -> None:  # type: ignore[no-untyped-def]
    llm = make_llama()
    first, second = (tuple(chat_ids(llm, q)) for q in QUESTIONS[:2])
    prompts = tmp_path / "prompts.json"
    ew.save(
        {
            ew.SPEC_BENCH: [ew.EnginePrompt(ew.SPEC_BENCH, "qa", "q/1", first)],
            ew.AGENT_REPEAT: [ew.EnginePrompt(ew.AGENT_REPEAT, p, "t/1", second) for p in ("pass1", "pass2")],
        },
        prompts,
    )
    out = tmp_path / "outputs.json"
    recorded = record(prompts, out, 12, n_threads=1)
    back = load_outputs(out)
    assert [(r.workload, r.group) for r in back] == [
        ("spec_bench", "qa"), ("agent_repeat", "pass1"), ("agent_repeat", "pass2"),
    ]  # fmt: skip
    assert all(np.array_equal(a.output, b.output) for a, b in zip(recorded, back, strict=True))
    assert all(0 < r.output.size <= 12 for r in back)
    # A first asking evaluates its whole prompt; one asked again starts from the state its first
    # asking kept (the benchmark's prompt cache).
    cache = PromptCache(1 << 30)
    for i, ids in enumerate((first, second)):
        llm.reset()
        assert greedy(llm, ids, 12) == back[i].output.tolist()
        cache.keep(llm, ids)
    assert cache.restore(llm, second)
    assert greedy(llm, second, 12) == back[2].output.tolist()

"""The in-process draft-path benchmark on real traces."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.draft_bench import DraftBenchConfig, run_draft_bench
from benchmarks.replay_bench import namespace_of
from benchmarks.traces import Conversation, Segment, read_traces
from cache_service.cli import main
from indexer.drafter import DraftParams
from indexer.prior import PriorConfig, StaticPrior
from indexer.tokens import SEPARATOR


def test_draft_bench_steps_real_sequences_and_digests_the_trees(shared_data: Path) -> None:
    conversations = read_traces(shared_data / "traces/spec_bench_vicuna7b.jsonl.gz", limit=40)
    namespace = namespace_of(conversations, 32000)
    config = DraftBenchConfig(batch=8, steps=120, rebuild_every=40)
    first = run_draft_bench(conversations, namespace, config)
    assert first["steps"] == 120 and first["batch"] == 8
    # Requests finished and were replaced; drafting from them beat one token per step.
    assert first["requests_finished"] > 0
    assert first["mat"] > 1.5
    assert 0 < first["draft_us_per_sequence_p50"] <= first["draft_us_per_sequence_p99"]
    assert first["draft_cpu_us_per_sequence"] > 0
    # Finishing and opening requests, and the 3 rebuilds, were timed.
    assert first["turnover_us_per_sequence"] > 0
    assert first["rebuild_ms_mean"] > 0
    # The same run drafts the same trees; other parameters draft others.
    assert run_draft_bench(conversations, namespace, config)["trees_sha256"] == first["trees_sha256"]
    smaller = DraftBenchConfig(batch=8, steps=120, rebuild_every=40, params=DraftParams(budget=4))
    assert run_draft_bench(conversations, namespace, smaller)["trees_sha256"] != first["trees_sha256"]


def test_draft_bench_config_is_checked() -> None:
    with pytest.raises(ValueError):
        DraftBenchConfig(batch=0)
    with pytest.raises(ValueError):
        DraftBenchConfig(rebuild_every=-1)
    with pytest.raises(ValueError, match="lookahead"):
        DraftBenchConfig(lookahead=17)


def test_draft_bench_drafts_ahead_when_asked(shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = shared_data / "traces/spec_bench_vicuna7b.jsonl.gz"
    args = ["bench-draft", str(traces), "--batch", "8", "--steps", "60", "--rebuild-every", "0"]
    reports = []
    for extra in ([], ["--lookahead", "2"]):
        assert main(args + extra) == 0
        reports.append(json.loads(capsys.readouterr().out))
    plain, ahead = reports
    assert plain["ahead_hit_rate"] is None
    # Outcomes drafted ahead for were verified, and their trees served: some, not all, hit.
    assert 0 < ahead["ahead_hit_rate"] < 1
    assert ahead["trees_sha256"] != plain["trees_sha256"]


def test_bench_draft_command_prints_the_report(shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = shared_data / "traces/spec_bench_vicuna7b.jsonl.gz"
    assert main(["bench-draft", str(traces), "--batch", "4", "--steps", "20", "--rebuild-every", "0"]) == 0
    out = capsys.readouterr().out
    assert '"trees_sha256"' in out and '"draft_us_per_sequence_p50"' in out


def test_bench_draft_takes_a_static_prior_file(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = shared_data / "traces/spec_bench_vicuna7b.jsonl.gz"
    docs = [np.append(np.concatenate([s.tokens for s in c.segments]), SEPARATOR) for c in read_traces(traces, limit=60)]
    prior = StaticPrior.build(np.concatenate(docs).astype(np.int32), PriorConfig(orders=(1, 2, 3)))
    (tmp_path / "prior.bin").write_bytes(prior.to_bytes())
    args = ["bench-draft", str(traces), "--batch", "4", "--steps", "30", "--rebuild-every", "0"]
    reports = []
    for extra in ([], ["--prior", str(tmp_path / "prior.bin")]):
        assert main(args + extra) == 0
        reports.append(json.loads(capsys.readouterr().out))
    without, with_prior = reports
    # The prior knows these very requests: it drafts other, longer-accepted trees.
    assert with_prior["trees_sha256"] != without["trees_sha256"]
    assert with_prior["mat"] > without["mat"]


def test_draft_bench_idles_between_steps_without_changing_the_trees(shared_data: Path) -> None:
    conversations = read_traces(shared_data / "traces/spec_bench_vicuna7b.jsonl.gz", limit=20)
    namespace = namespace_of(conversations, 32000)
    back_to_back = run_draft_bench(conversations, namespace, DraftBenchConfig(batch=4, steps=30, rebuild_every=0))
    began = time.perf_counter()
    idle = run_draft_bench(
        conversations, namespace, DraftBenchConfig(batch=4, steps=30, rebuild_every=0, step_interval_s=0.01)
    )
    # Each of the 29 steps after the first waited its 10 ms; the drafting itself is the same.
    assert time.perf_counter() - began >= 29 * 0.01
    assert idle["step_interval_ms"] == 10.0 and back_to_back["step_interval_ms"] == 0.0
    assert idle["trees_sha256"] == back_to_back["trees_sha256"]
    with pytest.raises(ValueError):
        DraftBenchConfig(step_interval_s=-0.001)


def test_draft_bench_drafts_chains_when_asked(shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = shared_data / "traces/spec_bench_vicuna7b.jsonl.gz"
    args = ["bench-draft", str(traces), "--batch", "8", "--steps", "60", "--rebuild-every", "0"]
    reports = []
    for extra in ([], ["--chain", "4"]):
        assert main(args + extra) == 0
        reports.append(json.loads(capsys.readouterr().out))
    trees, chains = reports
    # Chains of at most 4 tokens are verified: fewer tokens a step than trees, more than none.
    assert 1.0 < chains["mat"] < trees["mat"] and chains["mat"] <= 5.0
    assert chains["trees_sha256"] != trees["trees_sha256"]


def test_draft_bench_counts_the_tokens_a_request_has_not_a_bonus_past_its_end() -> None:
    # One request, asked again and again: the first time nothing is known, six steps for six
    # tokens; the second time the exact-prompt tier drafts the whole answer, accepted in one
    # step that ends the request with no bonus token to count: 12 tokens in 7 steps.
    conv = Conversation("c", "ns", "cat", (Segment("input", np.arange(10, 15, dtype=np.int32)),
                                           Segment("output", np.arange(20, 26, dtype=np.int32))))  # fmt: skip
    report = run_draft_bench([conv], namespace_of([conv], 100), DraftBenchConfig(batch=1, steps=7, rebuild_every=0))
    assert report["mat"] == round(12 / 7, 4)


def test_bench_draft_takes_a_prior_whose_ids_the_traces_never_use(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prior warmed from a corpus holds ids no request of the traces does (Llama-2's 32,000
    # against Spec-Bench's largest, 31,473): without --tokenizer the namespace is sized to hold
    # both, as the documented `bench-draft TRACES --prior PRIOR` needs.
    traces = shared_data / "traces/spec_bench_vicuna7b.jsonl.gz"
    toks = np.array([5, 6, 31_990, 31_991] * 4, dtype=np.int32)
    (tmp_path / "prior.bin").write_bytes(StaticPrior.build(toks, PriorConfig(orders=(1, 2))).to_bytes())
    args = ["bench-draft", str(traces), "--batch", "2", "--steps", "5", "--rebuild-every", "0"]
    assert main([*args, "--prior", str(tmp_path / "prior.bin")]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 5

"""The engine benchmark's llama-server runner: llama.cpp's own server with its own model-free
methods. The whole driver on the real server is a slow test (the binary is built by
``deploy/setup_llama_server.sh``, a benchmark peer kept out of the default set-up); what it
refuses is checked without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine_workloads import AGENT_REPEAT, SPEC_BENCH, build, save
from benchmarks.engines_bench import main
from benchmarks.engines_llamaserver import BINARY, METHODS, LlamaServerRunner, server_args

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_binary_or_unknown_method_stops_the_runner_before_any_server_starts(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no llama-server at"):
        LlamaServerRunner(binary=tmp_path / "llama-server", max_new_tokens=8, work_dir=tmp_path)
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 1\n")
    with pytest.raises(ValueError, match="unknown llama-server methods"):
        LlamaServerRunner(binary=fake, max_new_tokens=8, work_dir=tmp_path, methods=["ngram-nope"])
    assert not list(tmp_path.glob("*.log"))  # nothing was started


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: no such model' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with 3"):
        LlamaServerRunner(binary=fake, max_new_tokens=8, work_dir=tmp_path, methods=["plain"])
    assert "no such model" in (tmp_path / "llama-server-plain.log").read_text()


def test_each_method_is_the_server_with_its_own_speculative_settings() -> None:
    plain = server_args(Path("m.gguf"), port=1, n_ctx=2048, threads=0, cache_mib=64, method="plain")
    assert "--spec-type" not in plain and "--spec-default" not in plain and "-t" not in plain
    assert server_args(Path("m.gguf"), port=1, n_ctx=2048, threads=2, cache_mib=64, method="ngram-mod")[-2:] == [
        "--spec-default",
        "--no-webui",
    ]
    with pytest.raises(ValueError, match="unknown method"):
        server_args(Path("m.gguf"), port=1, n_ctx=2048, threads=1, cache_mib=64, method="eagle")


@pytest.mark.slow
def test_llama_server_lines_for_every_workload_and_method(shared_data: Path, tmp_path: Path) -> None:
    binary = ROOT / BINARY
    if not binary.is_file():
        pytest.skip(f"no llama-server at {binary}: bash deploy/setup_llama_server.sh builds it")
    workloads = build(shared_data, per_group=1, agent_tasks=1, max_user_tokens=500)
    workloads[SPEC_BENCH] = workloads[SPEC_BENCH][:2]
    prompts = tmp_path / "prompts.json"
    save(workloads, prompts)
    out = tmp_path / "lines.jsonl"
    main(
        [
            "--engine",
            "llama-server",
            "--workloads",
            str(prompts),
            "--llama-server-bin",
            str(binary),
            "--max-new-tokens",
            "48",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    expected = [(w, m) for w in (SPEC_BENCH, AGENT_REPEAT) for m in METHODS]
    assert [(x["workload"], x["method"]) for x in lines] == expected
    for x in lines:
        assert x["engine"] == "llama-server" and x["tokens_per_s"] > 0 and x["tokens"] > 0
        assert x["prompts"] == len(workloads[x["workload"]]) and x["decode_tokens_per_s"] > 0
        # Greedy with drafts verified by argmax: each method's output is the server's plain one
        # (but where a batched verification tips a near tie, as in llama-cpp-python).
        assert x["identical_to_greedy"] >= 0.5, x
    agent = {x["method"]: x for x in lines if x["workload"] == AGENT_REPEAT}
    assert agent["plain"]["drafted_tokens"] == 0 and agent["plain"]["mean_accepted_tokens"] == 1.0
    # Prompt lookup drafts from the request's own text (an agent's prompt holds what its answer repeats).
    assert agent["ngram-simple"]["drafted_tokens"] > 0 and agent["ngram-simple"]["accepted_tokens"] > 0
    # The n-gram pool is shared by every request of the server: pass 2 asks pass 1's task again,
    # and the pool has pass 1's answer.
    mod = agent["ngram-mod-short"]["by_group"]
    assert mod["pass2"]["mean_accepted_tokens"] > mod["pass1"]["mean_accepted_tokens"], mod

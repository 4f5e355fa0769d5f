"""Replay through gRPC drafts the same trees as the engine in-process."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from draftcache.v1 import draftcache_pb2 as pb

from benchmarks.baselines import EngineDrafter
from benchmarks.remote import RemoteDrafter
from benchmarks.replay import replay
from benchmarks.traces import read_traces, write_traces
from cache_service.cli import main
from cache_service.config import ServiceConfig
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.tokens import Namespace
from tests.service.conftest import start_service, stop_service


def test_remote_replay_matches_in_process(shared_data: Path) -> None:
    convs = read_traces(shared_data / "traces" / "spec_bench_vicuna7b.jsonl.gz", limit=25)
    local = replay(
        convs,
        EngineDrafter(
            NamespaceDrafter(Namespace(name="llama2", vocab_size=32000), DrafterConfig()), DraftParams(), rebuild=False
        ),
    )
    running = start_service(ServiceConfig())
    try:
        running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="llama2", vocab_size=32000))
        remote = RemoteDrafter(running.target, "llama2", DraftParams())
        over_grpc = replay(convs, remote)
        remote.close()
    finally:
        stop_service(running)
    # Same trees step by step, so the same number of steps and drafted tokens.
    assert over_grpc.steps == local.steps
    assert over_grpc.drafted == local.drafted
    assert over_grpc.mat == local.mat


@pytest.mark.parametrize("params", [DraftParams(), DraftParams(chain=8)], ids=["trees", "chains"])
def test_remote_replay_drafting_ahead_matches_in_process(shared_data: Path, params: DraftParams) -> None:
    convs = read_traces(shared_data / "traces" / "spec_bench_vicuna7b.jsonl.gz", limit=12)
    engine = NamespaceDrafter(Namespace(name="llama2", vocab_size=32000), DrafterConfig())
    local = replay(convs, EngineDrafter(engine, params, rebuild=False, lookahead=2))
    running = start_service(ServiceConfig())
    try:
        running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="llama2", vocab_size=32000))
        remote = RemoteDrafter(running.target, "llama2", params, lookahead=2)
        over_grpc = replay(convs, remote)
        remote.close()
    finally:
        stop_service(running)
    # The same outcomes were drafted ahead for, and the same trees served after them.
    assert local.ahead_hits > 0
    assert (over_grpc.ahead_hits, over_grpc.steps, over_grpc.drafted) == (local.ahead_hits, local.steps, local.drafted)
    assert (over_grpc.ahead_points, over_grpc.ahead_bonus) == (local.ahead_points, local.ahead_bonus)
    assert over_grpc.mat == local.mat


def test_remote_replay_of_several_namespaces(
    tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace of two tokenizers' traffic, interleaved, replays through the service as in process:
    each namespace on its own memory there, the same trees."""
    spec = read_traces(shared_data / "traces" / "spec_bench_vicuna7b.jsonl.gz", limit=6)
    swe = read_traces(shared_data / "traces" / "swe_agent_dev.jsonl.gz", limit=1)
    swe = [replace(c, segments=c.segments[:6]) for c in swe]  # its first turns: enough, and quick
    traces = tmp_path / "mixed.jsonl"
    write_traces([*spec[:3], *swe, *spec[3:]], traces)
    assert main(["replay", str(traces), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    running = start_service(ServiceConfig())
    try:
        assert main(["replay", str(traces), "--target", running.target, "--json"]) == 0
        remote = json.loads(capsys.readouterr().out)
        requests = {s.name: s.requests for s in running.service.stats()}
    finally:
        stop_service(running)
    # Each namespace's memory holds its own requests only.
    by_name = {name: rows[0]["requests"] for name, rows in local["by_namespace"].items()}
    assert requests == by_name and by_name["smollm2"] == 3
    assert list(remote["by_namespace"]) == list(local["by_namespace"]) == ["llama2", "smollm2"]
    for name, rows in local["by_namespace"].items():
        (ours,), (theirs,) = rows, remote["by_namespace"][name]
        assert (theirs["steps"], theirs["drafted_per_step"]) == (ours["steps"], ours["drafted_per_step"])
    assert remote["results"][0]["mat"] == local["results"][0]["mat"] > 1.5


def test_replay_through_a_service_takes_its_namespace_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The trace's largest id is 9: guessed from the trace, the vocabulary would be 10, which the
    # service's namespace of 32000 ids refuses (ALREADY_EXISTS). The replay asks the service.
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps(
            {
                "id": "a",
                "namespace": "llama2",
                "segments": [
                    {"kind": "input", "tokens": [1, 2, 3, 4]},
                    {"kind": "output", "tokens": [1, 2, 3, 4, 5, 9]},
                ],
            }
        )
        + "\n"
    )
    running = start_service(ServiceConfig())
    try:
        running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="llama2", vocab_size=32000))
        assert main(["replay", str(trace), "--target", running.target, "--json"]) == 0
    finally:
        stop_service(running)
    report = json.loads(capsys.readouterr().out)
    assert report["results"][0]["mat"] > 1.0

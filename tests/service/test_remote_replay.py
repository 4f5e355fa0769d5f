"""Replay through gRPC drafts the same trees as the engine in-process."""

from __future__ import annotations

from pathlib import Path

from draftcache.v1 import draftcache_pb2 as pb

from cache_service.config import ServiceConfig
from decoder_client.baselines import EngineDrafter
from decoder_client.remote import RemoteDrafter
from decoder_client.replay import replay
from decoder_client.traces import read_traces
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

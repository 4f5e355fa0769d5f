"""Every compiled loop the service runs is built (or loaded from numba's cache) while it starts,
none while it serves: a compilation holds the interpreter lock for seconds, and every call on
the event loop waits behind it. The same for a decoder's client, whose fallback must answer in
time when the service is down. Checked in fresh interpreters (``serving_workload``), where
nothing has been compiled yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.config import EmbeddedRedisConfig, ServiceConfig
from cache_service.host.embedded_redis import EmbeddedRedis
from indexer.prior import PriorConfig, StaticPrior
from tests.service.conftest import start_service, stop_service

ROOT = Path(__file__).resolve().parents[2]


def _workload(*args: str) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "proto")])}
    done = subprocess.run(
        [sys.executable, "-m", "tests.service.serving_workload", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_serving_compiles_and_loads_nothing_after_start_up(tmp_path: Path, shared_data: Path) -> None:
    corpus = np.random.default_rng(0).integers(3, 32000, 4000).astype(np.int32)
    prior = tmp_path / "prior.bin"
    prior.write_bytes(StaticPrior.build(np.tile(corpus, 2), PriorConfig(orders=(1, 2, 3))).to_bytes())
    redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    try:
        report = _workload(
            "server",
            redis.url,
            str(shared_data / "traces" / "spec_bench_vicuna7b.jsonl.gz"),
            str(shared_data / "tokenizers" / "llama2-spm"),
            str(prior),
            str(tmp_path / "shared"),
        )
    finally:
        redis.stop()
    assert report == {"compiled": [], "loaded": []}


def test_a_client_compiles_and_loads_nothing_after_it_is_made() -> None:
    running = start_service(ServiceConfig())
    try:
        running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=32000))
        report = _workload("client", running.target)
    finally:
        stop_service(running)
    assert report == {"compiled": [], "loaded": []}

"""A client's counts written to prometheus_client's multiprocess directory, as an engine whose
server collects that directory serves them (vLLM's OpenAI server, its proposer in another
process): real processes write, and the directory is read as such a server reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from decoder_client.client.core import ClientStats
from decoder_client.client.metrics import ClientCollector, MultiprocessMirror
from decoder_client.engines.settings import EngineSettings
from tests.faults import wait_for

CHECKOUT = Path(__file__).resolve().parents[2]

# One engine process: its counts written, grown (the mirror's thread writes them), grown again
# (its close writes them); it waits on its stdin between the two.
ENGINE = """
import sys
from decoder_client.client.core import ClientStats
from decoder_client.client.metrics import ClientCollector, ClientMetrics
near, version = int(sys.argv[1]), int(sys.argv[2])
stats = ClientStats(near=near, fallback=1, commits_pending=2, prior_version=version)
metrics = ClientMetrics.serve(ClientCollector(lambda: stats, namespace="chat", engine="vllm"), 0)
assert metrics is not None and metrics.port == 0  # no port: the directory only
stats.near += 5  # the mirror's thread writes it within its second
print("grown", flush=True)
sys.stdin.readline()
stats.near += 1
stats.commits_pending = 0
metrics.close()
"""


def _engine(folder: Path, near: int, version: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    args = [sys.executable, "-c", ENGINE, str(near), str(version)]
    return subprocess.Popen(args, env=env, cwd=CHECKOUT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _served(folder: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a server collecting ``folder`` serves: each sample's value by name and labels."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect() for s in family.samples}


def _labels(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"namespace": "chat", "engine": "vllm", **extra}.items()))


def test_two_engine_processes_counts_are_served_summed_from_the_directory(tmp_path: Path) -> None:
    engines = [_engine(tmp_path, 10, 3), _engine(tmp_path, 20, 7)]
    try:
        for engine in engines:
            assert engine.stdout is not None and engine.stdout.readline().strip() == "grown"
        near = ("draftcache_client_drafts_total", _labels(source="near"))
        wait_for(lambda: _served(tmp_path).get(near) == 15 + 25, 10, "each mirror's thread to write what grew")
        grown = _served(tmp_path)
        assert grown[("draftcache_client_commits_pending", _labels())] == 2 + 2  # summed
        assert grown[("draftcache_client_near_prior_version", _labels())] == 7  # the newest
        for engine in engines:
            engine.communicate("\n", timeout=30)
            assert engine.returncode == 0
    finally:
        for engine in engines:
            engine.kill()
    served = _served(tmp_path)
    assert served[("draftcache_client_drafts_total", _labels(source="near"))] == 16 + 26  # close wrote the last
    assert served[("draftcache_client_drafts_total", _labels(source="fallback"))] == 2
    assert served[("draftcache_client_drafts_total", _labels(source="service"))] == 0  # every series, at 0 too
    assert served[("draftcache_client_commits_pending", _labels())] == 0
    # The same metrics, by name and labels, as the client's own /metrics serves (what the
    # alert rules and the dashboard read).
    direct = CollectorRegistry()
    direct.register(ClientCollector(ClientStats, namespace="chat", engine="vllm"))
    text = generate_latest(direct).decode()
    expected = {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }
    assert expected == set(served)


# An engine whose metrics cannot go where they were asked to: it starts all the same, with
# whatever outlet is left. argv: "taken" (its port held by another socket) or "free", and
# prints the port served (0: none) and whether the counts are mirrored.
OUTLETS = """
import socket, sys
from decoder_client.client.core import ClientStats
from decoder_client.client.metrics import ClientCollector, ClientMetrics
held = socket.socket()
held.bind(("127.0.0.1", 0))
port = held.getsockname()[1]
if sys.argv[1] == "taken":
    held.listen()
else:
    held.close()
metrics = ClientMetrics.serve(ClientCollector(ClientStats, namespace="chat", engine="vllm"), port)
print(0 if metrics is None else int(metrics.port == port), int(metrics is not None and metrics._mirror is not None))
if metrics is not None:
    metrics.close()
"""


@pytest.mark.parametrize(
    ("folder", "port", "outlets"),
    [("made", "taken", "0 1"), ("missing", "free", "1 0"), ("missing", "taken", "0 0")],
    ids=["port-taken-mirrored", "folder-missing-served", "neither"],
)
def test_metrics_that_cannot_go_where_asked_stop_nothing(tmp_path: Path, folder: str, port: str, outlets: str) -> None:
    where = tmp_path / "prometheus"
    if folder == "made":
        where.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(where)}
    run = subprocess.run(
        [sys.executable, "-c", OUTLETS, port], env=env, cwd=CHECKOUT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == outlets, run.stderr
    assert ("cannot write the client's metrics" in run.stderr) == (folder == "missing"), run.stderr


def test_without_a_port_or_a_directory_nothing_is_started() -> None:
    assert not MultiprocessMirror.available()  # this process keeps its values in memory
    settings = EngineSettings(namespace="chat")
    assert settings.client_metrics(_Stats(), "vllm") is None  # type: ignore[arg-type]


class _Stats:
    stats = ClientStats()

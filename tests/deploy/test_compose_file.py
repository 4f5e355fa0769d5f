"""deploy/docker-compose.yml against the Compose Specification's JSON schema (the copy that
check-jsonschema ships as ``vendor.compose-spec``), and what its services promise each other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    COMPOSE,
    GRPC_PORT,
    REDIS_PORT,
    START_S,
    compose,
    dockerfile_env,
    duration_s,
    healthcheck_module,
    k8s_base,
)

REPLICAS = ("draftcache-1", "draftcache-2")


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_compose_file_matches_the_compose_spec() -> None:
    out = check_compose_schema(COMPOSE)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda c: c["services"]["redis"].update(healthchek={"test": ["CMD", "true"]}), id="unknown-key"),
        pytest.param(
            lambda c: c["services"]["decoder"]["depends_on"]["draftcache-1"].update(condition="service_ready"),
            id="bad-condition",
        ),
        pytest.param(lambda c: c["services"]["draftcache-1"].update(ports="50051"), id="wrong-type"),
    ],
)
def test_the_schema_rejects_a_broken_compose_file(tmp_path: Path, breakage: Any) -> None:
    broken = compose()
    breakage(broken)
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    out = check_compose_schema(path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Schema validation errors" in out.stdout


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def test_redis_keeps_an_append_only_file_on_a_volume() -> None:
    redis = service("redis")
    command = redis["command"]
    assert command[0] == "redis-server" and command[command.index("--appendonly") + 1] == "yes"
    volume, _, target = redis["volumes"][0].partition(":")
    assert volume in compose()["volumes"] and target == "/data"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    # The same Redis as the Kubernetes StatefulSet runs.
    statefulset = k8s_base("StatefulSet", "draftcache-redis")
    assert redis["image"] == statefulset["spec"]["template"]["spec"]["containers"][0]["image"]


def journal_volume(name: str) -> str:
    """The named volume a replica's --data-dir (its commit journal) lives on."""
    replica = service(name)
    data_dir = Path(replica["environment"].get("DRAFTCACHE_DATA_DIR") or dockerfile_env()["DRAFTCACHE_DATA_DIR"])
    mounts = [str(m).split(":") for m in replica.get("volumes", [])]
    holding = [(src, Path(dst)) for src, dst, *_ in mounts if Path(dst) in (data_dir, *data_dir.parents)]
    assert holding, f"{name}: {data_dir} is on no volume (an anonymous one, lost when the container is recreated)"
    source, _ = max(holding, key=lambda m: len(m[1].parts))  # the innermost
    assert source in compose()["volumes"], f"{name}: {data_dir} is on {source!r}, not a named volume"
    return source


def test_each_replica_keeps_its_journal_on_a_named_volume_of_its_own() -> None:
    """A commit Redis cannot take is acknowledged once fsynced to the journal in --data-dir:
    the journal must outlive the container, and is one process's alone."""
    volumes = [journal_volume(name) for name in REPLICAS]
    assert len(set(volumes)) == len(REPLICAS)


def test_a_journal_on_no_volume_is_caught() -> None:
    doc = compose()
    doc["services"]["draftcache-1"].pop("volumes")
    with pytest.MonkeyPatch.context() as m:
        m.setattr("test_compose_file.compose", lambda: doc)
        with pytest.raises(AssertionError, match="on no volume"):
            journal_volume("draftcache-1")


def test_the_replicas_check_gets_time_to_answer() -> None:
    deadline = healthcheck_module().DEFAULT_TIMEOUT_S
    for name in REPLICAS:
        timeout = duration_s(service(name)["healthcheck"]["timeout"])
        assert timeout - START_S <= deadline < timeout, name


def test_replicas_share_the_redis_and_wait_for_it() -> None:
    for name in REPLICAS:
        replica = service(name)
        assert replica["environment"]["DRAFTCACHE_REDIS_URL"] == f"redis://redis:{REDIS_PORT}/0"
        assert replica["depends_on"] == {"redis": {"condition": "service_healthy"}}
        # The image's health check script (grpc.health.v1), at the path the Dockerfile copies it to.
        assert replica["healthcheck"]["test"] == ["CMD", "python", "/opt/draftcache/healthcheck.py"]
        _host_port, container_port = replica["ports"][0].rsplit(":", 2)[-2:]
        assert int(container_port) == GRPC_PORT == int(replica["environment"]["DRAFTCACHE_PORT"])
    published = [service(n)["ports"][0].split(":")[1] for n in REPLICAS]
    assert len(set(published)) == len(REPLICAS), "each replica on its own host port"


def test_demo_jobs_run_real_commands_against_the_replicas() -> None:
    from cache_service.cli import build_parser

    decoder = service("decoder")
    args = build_parser().parse_args(decoder["command"])
    assert args.command == "bench-load"
    assert args.target == [f"{n}:{GRPC_PORT}" for n in REPLICAS]
    assert decoder["depends_on"] == {n: {"condition": "service_healthy"} for n in REPLICAS}
    prior = build_parser().parse_args(service("prior")["command"])
    assert prior.command == "warm" and prior.redis_url == f"redis://redis:{REDIS_PORT}/0"
    for job in (decoder, service("prior")):
        assert job["profiles"] == ["demo"]
        assert job["healthcheck"] == {"disable": True}
        # The project's shared data, read-only at /data: traces, corpora, tokenizers.
        source, target, mode = job["volumes"][0].rsplit(":", 2)
        assert source.endswith("/shared}/data") and (target, mode) == ("/data", "ro")
    paths = [str(a) for a in (args.traces, args.tokenizer, prior.tokenizer, prior.corpus)]
    assert all(p.startswith("/data/") for p in paths)


def test_the_demo_data_exists_where_the_jobs_read_it(shared_data: Path) -> None:
    for job in ("decoder", "prior"):
        for arg in service(job)["command"]:
            if str(arg).startswith("/data/"):
                assert (shared_data / str(arg).removeprefix("/data/")).exists(), arg


def test_image_defaults_are_what_compose_relies_on() -> None:
    env = dockerfile_env()
    assert env["DRAFTCACHE_HOST"] == service(REPLICAS[0])["environment"]["DRAFTCACHE_HOST"] == "0.0.0.0"

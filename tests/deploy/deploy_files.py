"""The deployment artefacts under ``deploy/``, read the way the tests beside this file need them:
YAML documents, the Dockerfile's instructions, env files, and what ``draftcache`` accepts."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import dockerfile
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HEALTHCHECK = DEPLOY / "healthcheck.py"
UNIT = DEPLOY / "systemd" / "draftcache.service"
UNIT_ENV = DEPLOY / "systemd" / "draftcache.env"

GRPC_PORT = 50051
REDIS_PORT = 6379
PREFIX = "DRAFTCACHE_"
# Variables that deploy/healthcheck.py reads beside the server's own (no flags of ``serve``).
HEALTHCHECK_ONLY = frozenset({"DRAFTCACHE_TLS_CA", "DRAFTCACHE_TLS_SERVER_NAME"})


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def _patch_files() -> set[Path]:
    """Files that kustomizations use as patches: partial objects, not resources."""
    out = set()
    for k in kustomizations():
        for patch in load_docs(k)[0].get("patches", []):
            if "path" in patch:
                out.add((k.parent / patch["path"]).resolve())
    return out


def k8s_resource_files() -> list[Path]:
    patches = _patch_files()
    return [p for p in yaml_files() if K8S in p.parents and p.name != "kustomization.yaml" and p not in patches]


def k8s_resources() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in k8s_resource_files() for d in load_docs(p)]


def k8s_base(kind: str, name: str) -> dict[str, Any]:
    """One resource of the base manifests."""
    found = [d for p, d in k8s_resources() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} definitions"
    return found[0]


def compose() -> dict[str, Any]:
    """docker-compose.yml with YAML merge keys resolved, as Compose reads it."""
    doc = load_docs(COMPOSE)[0]
    assert isinstance(doc, dict)
    return doc


def docker_commands() -> tuple[dockerfile.Command, ...]:
    """The Dockerfile's instructions, parsed by moby/buildkit's own parser."""
    return dockerfile.parse_file(str(DOCKERFILE))


def final_stage() -> list[dockerfile.Command]:
    commands = docker_commands()
    last_from = max(i for i, c in enumerate(commands) if c.cmd.upper() == "FROM")
    return list(commands[last_from:])


def env_pairs(command: dockerfile.Command) -> Iterator[tuple[str, str]]:
    """``ENV a=1 b=2`` (the parser yields key, value, key, value, ...)."""
    values = command.value
    for i in range(0, len(values), 2):
        yield values[i], values[i + 1]


def duration_s(text: str) -> float:
    """A Docker / Compose duration such as ``5s``, ``1m30s`` or ``500ms``."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


# What the interpreter's start and the script's imports may take beside the script's deadline.
START_S = 1.5


def healthcheck_module() -> ModuleType:
    """deploy/healthcheck.py, imported (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("draftcache_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import registers it (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def healthcheck_in_image() -> str:
    """Where the Dockerfile copies deploy/healthcheck.py in the image."""
    (path,) = [c.value[-1] for c in final_stage() if c.cmd.upper() == "COPY" and c.value[0] == "deploy/healthcheck.py"]
    return str(path)


def overlay_env(overlay: str) -> dict[str, str]:
    """The variables an overlay's StatefulSet patch sets on the server container (a value, or a
    stand-in for one from a Secret)."""
    patch = next(
        d
        for path in (K8S / "overlays" / overlay).glob("*.yaml")
        if path.name != "kustomization.yaml"
        for d in load_docs(path)
        if d.get("kind") == "StatefulSet"
    )
    env = patch["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e.get("value", "redis://from-a-secret:6379/0") for e in env}


def dockerfile_env() -> dict[str, str]:
    return {k: v for c in final_stage() if c.cmd.upper() == "ENV" for k, v in env_pairs(c)}


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments and blanks skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def draftcache_vars(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(PREFIX)}


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    from cache_service.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def env_var_of(option: str) -> str:
    """``--rebuild-interval`` -> ``DRAFTCACHE_REBUILD_INTERVAL``, as the CLI's ``_add`` maps it."""
    return PREFIX + option.lstrip("-").upper().replace("-", "_")


def option_of(var: str, subcommand: str) -> str | None:
    """The long option of ``subcommand`` that ``var`` sets, if any."""
    for action in subcommand_parser(subcommand)._actions:
        for option in action.option_strings:
            if option.startswith("--") and env_var_of(option) == var:
                return option
    return None


def unit_directives(path: Path = UNIT) -> list[tuple[str, str, str]]:
    """(section, key, value) for every line of a systemd unit; keys may repeat."""
    out, section = [], ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def tool(name: str) -> str | None:
    """A command-line tool from this interpreter's environment (pip-installed), else PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def run_script(script: str, args: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    """``bash deploy/<script> args`` run as an operator runs it: from ``cwd``, with this
    Python's ``draftcache`` first on PATH and ``env`` added to the environment."""
    return subprocess.run(
        ["bash", str(DEPLOY / script), *args],
        cwd=cwd,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )

"""What the deployment artefacts promise each other and the code: every YAML file parses, every
DRAFTCACHE_* setting they give ``draftcache serve`` is one of its flags with a value it accepts,
one gRPC port and one metrics port everywhere, and the real ``draftcache serve`` starts, reports
SERVING on the grpc.health.v1 service, serves its metrics and stops cleanly on each artefact's
own settings."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    DEPLOY,
    GRPC_PORT,
    HEALTHCHECK,
    HEALTHCHECK_ONLY,
    UNIT_ENV,
    compose,
    docker_commands,
    dockerfile_env,
    draftcache_vars,
    duration_s,
    k8s_base,
    load_docs,
    option_of,
    overlay_env,
    read_env_file,
    unit_directives,
    yaml_files,
)

from cache_service.app import stop_seconds
from cache_service.config import ServerConfig
from cache_service.host.embedded_redis import EmbeddedRedis, free_port
from tests.faults import READY_S


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs and all(isinstance(d, dict) for d in docs)


def test_a_yaml_error_is_caught() -> None:
    with pytest.raises(yaml.YAMLError):
        yaml.safe_load("data:\n  DRAFTCACHE_PORT: [50051\n")


def unit_environment() -> dict[str, str]:
    items = [item for s, k, v in unit_directives() if k == "Environment" for item in v.split()]
    return dict(item.split("=", 1) for item in items)


def serve_settings() -> dict[str, dict[str, str]]:
    """Every place that hands ``draftcache serve`` DRAFTCACHE_* settings, by name."""
    services = compose()["services"]
    return {
        "Dockerfile ENV": draftcache_vars(dockerfile_env()),
        "compose draftcache-1": draftcache_vars(services["draftcache-1"]["environment"]),
        "compose draftcache-2": draftcache_vars(services["draftcache-2"]["environment"]),
        "k8s ConfigMap": draftcache_vars(k8s_base("ConfigMap", "draftcache")["data"]),
        "k8s external-redis overlay": draftcache_vars(overlay_env("external-redis")),
        "k8s tls overlay": {k: v for k, v in overlay_env("tls").items() if k not in HEALTHCHECK_ONLY},
        "systemd env file": draftcache_vars(read_env_file(UNIT_ENV)),
        "systemd unit Environment=": draftcache_vars(unit_environment()),
    }


@pytest.mark.parametrize("source", list(serve_settings()))
def test_settings_are_serve_flags_with_accepted_values(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cache_service.cli import build_parser

    settings = serve_settings()[source]
    assert settings, f"{source} sets nothing"
    for var in [v for v in os.environ if v.startswith("DRAFTCACHE_")]:
        monkeypatch.delenv(var)
    explicit = ["serve"]
    for var, value in settings.items():
        option = option_of(var, "serve")
        assert option is not None, f"{source}: {var} is not a flag of draftcache serve"
        explicit += [option, str(value)]
    from_flags = build_parser().parse_args(explicit)  # a value of the wrong type exits here
    for var, value in settings.items():
        monkeypatch.setenv(var, str(value))
    assert build_parser().parse_args(["serve"]) == from_flags, "the variables act as the flags do"


def test_a_variable_that_is_no_flag_is_caught() -> None:
    assert option_of("DRAFTCACHE_REBUILD_INTERVAL", "serve") == "--rebuild-interval"
    assert option_of("DRAFTCACHE_BUDGET", "serve") is None  # a replay/bench flag, not serve's


def test_one_grpc_port_everywhere() -> None:
    services = compose()["services"]
    container = k8s_base("StatefulSet", "draftcache")["spec"]["template"]["spec"]["containers"][0]
    claims: dict[str, Any] = {
        "Dockerfile EXPOSE": next(c.value[0] for c in docker_commands() if c.cmd.upper() == "EXPOSE"),
        "Dockerfile ENV": dockerfile_env()["DRAFTCACHE_PORT"],
        "k8s ConfigMap": k8s_base("ConfigMap", "draftcache")["data"]["DRAFTCACHE_PORT"],
        "k8s containerPort": container["ports"][0]["containerPort"],
        "k8s Service": k8s_base("Service", "draftcache")["spec"]["ports"][0]["port"],
        "k8s headless Service": k8s_base("Service", "draftcache-headless")["spec"]["ports"][0]["port"],
        "systemd env file": read_env_file(UNIT_ENV)["DRAFTCACHE_PORT"],
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        claims[f"k8s {probe}"] = container[probe]["grpc"]["port"]
    for name in ("draftcache-1", "draftcache-2"):
        claims[f"compose {name} env"] = services[name]["environment"]["DRAFTCACHE_PORT"]
        claims[f"compose {name} container port"] = services[name]["ports"][0].rsplit(":", 1)[1]
    assert {k: int(v) for k, v in claims.items()} == dict.fromkeys(claims, GRPC_PORT)


METRICS_PORT = 9464


def test_one_metrics_port_everywhere() -> None:
    """Every artefact serves Prometheus metrics, on one port, where its scrapes look for them."""
    services = compose()["services"]
    pod = k8s_base("StatefulSet", "draftcache")["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    targets = [t for job in scrape for c in job["static_configs"] for t in c["targets"]]
    claims: dict[str, Any] = {
        "k8s ConfigMap": k8s_base("ConfigMap", "draftcache")["data"]["DRAFTCACHE_METRICS_PORT"],
        "k8s containerPort": ports["metrics"],
        "k8s pod annotation": pod["metadata"]["annotations"]["prometheus.io/port"],
        "systemd env file": read_env_file(UNIT_ENV)["DRAFTCACHE_METRICS_PORT"],
    }
    for name in ("draftcache-1", "draftcache-2"):
        claims[f"compose {name} env"] = services[name]["environment"]["DRAFTCACHE_METRICS_PORT"]
        assert f"{name}:{METRICS_PORT}" in targets, f"compose's Prometheus does not scrape {name}"
    assert {k: int(v) for k, v in claims.items()} == dict.fromkeys(claims, METRICS_PORT)
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # The systemd host's metrics stay on its loopback unless the operator opens them.
    assert read_env_file(UNIT_ENV)["DRAFTCACHE_METRICS_HOST"] == "127.0.0.1"


def real_serve_env(settings: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """An artefact's settings on this machine: loopback, free ports, the embedded Redis in a
    scratch folder instead of the deployment's Redis."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTCACHE_")}
    env.update(settings)
    env.pop("DRAFTCACHE_REDIS_URL", None)
    env.update(DRAFTCACHE_HOST="127.0.0.1", DRAFTCACHE_PORT=str(free_port()), DRAFTCACHE_DATA_DIR=str(tmp_path))
    if "DRAFTCACHE_METRICS_PORT" in env:
        env.update(DRAFTCACHE_METRICS_PORT=str(free_port()), DRAFTCACHE_METRICS_HOST="127.0.0.1")
    return env


def serves_healthy_and_stops(env: dict[str, str]) -> None:
    """``draftcache serve`` on ``env`` alone reports SERVING to deploy/healthcheck.py run on the
    same variables (as a container's check or an exec probe is), then stops on SIGTERM."""
    cmd = [sys.executable, "-m", "cache_service.cli", "serve"]  # no flags: all from the environment
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + READY_S  # the first server compiles every kernel first
        while True:
            check = subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, text=True)
            if check.returncode == 0:
                break
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, check.stdout
            time.sleep(0.2)
        assert check.stdout.strip() == f"127.0.0.1:{env['DRAFTCACHE_PORT']} (server): SERVING"
        if "DRAFTCACHE_METRICS_PORT" in env:  # what the artefact's scrape reads
            url = f"http://127.0.0.1:{env['DRAFTCACHE_METRICS_PORT']}/metrics"
            assert "draftcache_storage_up 1.0" in urllib.request.urlopen(url, timeout=10).read().decode()
        proc.terminate()  # SIGTERM, as docker stop, the kubelet and systemd send it
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("source", ["k8s ConfigMap", "compose draftcache-1", "systemd env file"])
def test_serve_starts_healthy_and_stops_on_the_artefact_settings(source: str, tmp_path: Path) -> None:
    settings = serve_settings()[source]
    assert "DRAFTCACHE_METRICS_PORT" in settings, f"{source} serves no metrics"
    serves_healthy_and_stops(real_serve_env(settings, tmp_path))


def test_serve_starts_healthy_over_tls_on_the_tls_overlay_settings(pki: Path, tmp_path: Path) -> None:
    """The overlay's variables, its Secret's files (tls.crt, tls.key) standing in for a test
    certificate of 127.0.0.1 and localhost: the check the overlay's probes run finds the server
    SERVING over TLS, as it must for the pods ever to be ready."""
    settings = {**serve_settings()["k8s ConfigMap"], **overlay_env("tls")}
    stand_in = {"tls.crt": pki / "server.pem", "tls.key": pki / "server.key"}
    for var in ("DRAFTCACHE_TLS_CERT", "DRAFTCACHE_TLS_KEY"):
        settings[var] = str(stand_in[Path(settings[var]).name])
    assert settings.pop("DRAFTCACHE_TLS_SERVER_NAME") == "draftcache"  # the Service's name
    settings["DRAFTCACHE_TLS_SERVER_NAME"] = "localhost"  # the test certificate's
    serves_healthy_and_stops(real_serve_env(settings, tmp_path))


DOCKER_DEFAULT_STOP_S = 10  # `docker stop` / `docker run` without --stop-timeout


def stop_budget_s(*, pre_stop_s: float = 0.0, embedded: bool) -> float:
    """What ``draftcache serve`` may take from SIGTERM to its exit whatever storage does, hung
    included (cache_service/app.py, App.stop and stop_seconds): the drain, the background jobs'
    end and the last session write-back and log sync, each cut short at its deadline, then the
    embedded Redis's own stop; and before SIGTERM, a preStop hook's sleep."""
    redis_s = inspect.signature(EmbeddedRedis.stop).parameters["timeout_s"].default if embedded else 0.0
    return pre_stop_s + stop_seconds(ServerConfig().grace_s) + redis_s


def documented_docker_runs() -> list[tuple[str, list[str]]]:
    """Every ``docker run`` of the image that starts the server, as deploy/README.md and the
    Dockerfile's header write it."""
    runs = []
    for path in (DEPLOY / "README.md", DEPLOY / "Dockerfile"):
        for match in re.finditer(r"docker run [^`\n]*", path.read_text()):
            words = shlex.split(match.group(0).split("#")[0])
            image = next(i for i, w in enumerate(words) if w.startswith("draftcache:"))
            if words[image + 1 :] in ([], ["serve"]):  # the image's command: serve
                runs.append((f"{path.name}: {match.group(0)}", words))
    return runs


def docker_stop_timeout(words: list[str]) -> float:
    for i, word in enumerate(words):
        if word == "--stop-timeout":
            return float(words[i + 1])
        if word.startswith("--stop-timeout="):
            return float(word.split("=", 1)[1])
    return DOCKER_DEFAULT_STOP_S


def test_every_stop_grace_covers_the_server_stop() -> None:
    """SIGKILL before the server has stopped loses the sessions' last write-back and, on the
    embedded Redis, stops it uncleanly: every deployment waits at least the server's stop."""
    pod = k8s_base("StatefulSet", "draftcache")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sleep, seconds = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    embedded_k8s = "DRAFTCACHE_REDIS_URL" not in k8s_base("ConfigMap", "draftcache")["data"]
    assert pod["terminationGracePeriodSeconds"] >= stop_budget_s(pre_stop_s=float(seconds), embedded=embedded_k8s)
    for name in ("draftcache-1", "draftcache-2"):
        service = compose()["services"][name]
        embedded = "DRAFTCACHE_REDIS_URL" not in service["environment"]
        assert duration_s(service["stop_grace_period"]) >= stop_budget_s(embedded=embedded), name
    unit = {k: v for section, k, v in unit_directives() if section == "Service"}
    embedded = "DRAFTCACHE_REDIS_URL" not in read_env_file(UNIT_ENV)
    assert float(unit["TimeoutStopSec"]) >= stop_budget_s(embedded=embedded)
    runs = documented_docker_runs()
    assert runs, "deploy/README.md shows how to run the image"
    for where, words in runs:
        embedded = not any(w.startswith("DRAFTCACHE_REDIS_URL=") for w in words)
        assert docker_stop_timeout(words) >= stop_budget_s(embedded=embedded), where


def test_a_docker_run_without_a_stop_timeout_is_caught() -> None:
    words = ["docker", "run", "--rm", "draftcache:0.1.0"]
    assert docker_stop_timeout(words) == DOCKER_DEFAULT_STOP_S < stop_budget_s(embedded=True)
    assert docker_stop_timeout([*words[:2], "--stop-timeout=40", *words[2:]]) == 40

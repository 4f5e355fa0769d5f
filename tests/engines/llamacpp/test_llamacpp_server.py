"""llama-cpp-python's OpenAI-compatible server with draftcache as its draft model
(``python -m decoder_client.engines.llamacpp_server``), run for real on SmolLM2 beside a real
``draftcache serve``: completions answered over HTTP, each committed to the service's lifetime
log when it stops, a request asked again drafted from it, and the open generation committed
when the server is stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_service.host.embedded_redis import free_port
from tests.engines.llamacpp.conftest import NAMESPACE
from tests.faults import Serve, log_entries, wait_for

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[llamacpp]'")
pytest.importorskip("uvicorn", reason="llama-cpp-python's server is not installed: pip install -e '.[llamacpp]'")

PROMPT = "Repeat this sentence three times: The quick brown fox jumps over the lazy dog near the river bank.\n"


def post(port: int, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def scraped(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample ``/metrics`` on ``port`` serves, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = text_string_to_metric_families(text)
    return {(m.name, tuple(sorted(m.labels.items()))): m.value for f in families for m in f.samples}


@pytest.mark.parametrize(
    ("near", "beside"),
    [(True, False), (False, False), (True, True)],
    ids=["near", "through-the-service", "beside-a-model"],
)
def test_the_server_drafts_and_commits_every_completion(
    gguf: Path, serve: Serve, tmp_path: Path, near: bool, beside: bool
) -> None:
    """Drafting near (the default: a near copy in the server's process) or through the service
    (``near=false``: the service drafts every step), or near beside a small draft model (the
    only GGUF here, the served model itself): each completion is committed when it stops."""
    port, metrics = free_port(), free_port()
    env = {**os.environ, "DRAFTCACHE_TARGET": f"127.0.0.1:{serve.port}", "DRAFTCACHE_NAMESPACE": NAMESPACE}
    env["DRAFTCACHE_METRICS_PORT"] = str(metrics)  # a setting from the environment, as any
    log = (tmp_path / "server.log").open("w")
    cmd = [sys.executable, "-m", "decoder_client.engines.llamacpp_server", "--model", str(gguf), "--port", str(port)]
    if beside:
        cmd += ["--draftcache-model", str(gguf)]
    server = subprocess.Popen(
        [*cmd, "--n_ctx", "1024", "--n_threads", "1", "--draftcache", "deadline_s=0.25", "--draftcache", f"{near=}"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: server.poll() is not None or ready(port), 120, "the server")
        assert server.poll() is None, (tmp_path / "server.log").read_text()
        before = len(log_entries(serve.redis_url(), NAMESPACE))
        body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0.0}
        first = post(port, "/v1/completions", body)
        text = first["choices"][0]["text"]
        assert first["usage"]["completion_tokens"] > 0 and text
        # Committed when the completion stopped: prompt and answer in the service's log.
        wait_for(lambda: len(log_entries(serve.redis_url(), NAMESPACE)) == before + 1, 30, "the first commit")
        drafts_before = serve.stats().drafts
        again = post(port, "/v1/completions", body)
        assert again["choices"][0]["text"]
        # The service drafted for the server's steps, or (near) nothing: the near copy did.
        assert (serve.stats().drafts == drafts_before) if near else (serve.stats().drafts > drafts_before)
        # Its session closed when it stopped (its log entry may be empty: the service holds it all).
        wait_for(lambda: serve.stats().sessions == 0, 30, "the second session closed")
        # A chat completion goes through the same engine, and the same draft model.
        chat = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8})
        assert chat["choices"][0]["message"]["content"] is not None
        wait_for(lambda: len(log_entries(serve.redis_url(), NAMESPACE)) >= before + 2, 30, "the chat's commit")
        # The draft model's counts, served for Prometheus from the server's process: on the
        # metrics port, and the same on the server's own port.
        got = scraped(metrics)
        labels = (("engine", "llama.cpp"), ("namespace", NAMESPACE))
        source = "near" if near else "service"
        assert got[("draftcache_client_drafts_total", (*labels, ("source", source)))] > 0, got
        assert got[("draftcache_engine_steps_total", labels)] > 0
        assert scraped(port) == got  # idle: nothing changes between the two
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
        log.close()
    # Stopped gracefully (uvicorn ends with the signal that stopped it, once the app shut down).
    text = (tmp_path / "server.log").read_text()
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in text, text[-3000:]
    assert "drafts from" in text and "Traceback" not in text  # the launcher's draft model was loaded
    assert "without flash attention" not in text  # the launcher turned it on (attach warns otherwise)
    assert ("(near)" in text) == near
    assert ("beside the draft model" in text) == beside
    assert "1 draft models closed" in text  # ... and closed while the server stopped


def test_a_bad_draftcache_setting_stops_the_launcher_before_the_model_loads(gguf: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "decoder_client.engines.llamacpp_server", "--model", str(gguf)],
        env={k: v for k, v in os.environ.items() if not k.startswith("DRAFTCACHE_")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "draftcache needs a namespace" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "decoder_client.engines.llamacpp_server", "--model", str(gguf), "--draft_model", "x"],
        env={**os.environ, "DRAFTCACHE_TARGET": "127.0.0.1:1", "DRAFTCACHE_NAMESPACE": NAMESPACE},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "draftcache is this server's draft model" in run.stderr
    missing = ["--draftcache-model", str(gguf.with_name("missing.gguf"))]
    run = subprocess.run(
        [sys.executable, "-m", "decoder_client.engines.llamacpp_server", "--model", str(gguf), *missing],
        env={**os.environ, "DRAFTCACHE_TARGET": "127.0.0.1:1", "DRAFTCACHE_NAMESPACE": NAMESPACE},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--draftcache-model: no such file" in run.stderr

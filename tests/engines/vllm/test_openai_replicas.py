"""vLLM's OpenAI-compatible server with draftcache as its proposer, two replicas sharing one
``draftcache serve``: what replica 1 answered makes the same request on replica 2 draft better
(vLLM's own spec-decode counters on each replica's /metrics). Both ways of drafting: through the
service, and near (each replica's near copy follows the service's log for the other's commits).

Slow (two servers start, about a minute each): ``-m slow``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_service.host.embedded_redis import free_port
from decoder_client.engines.vllm import speculative_config
from tests.engines.vllm.conftest import CHECKOUT, MAX_MODEL_LEN, NAMESPACE, K
from tests.faults import Serve, wait_for

pytestmark = pytest.mark.slow

QUESTION = "Write a Python function that checks whether a string is a palindrome, with three examples of its use."


class ApiServer:
    """``python -m vllm.entrypoints.openai.api_server`` with draftcache as its proposer."""

    def __init__(
        self,
        model: Path,
        service_port: int,
        core: int,
        log: Path,
        near: bool,
        namespace: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            # As make_llm's engines: on a CPU with bf16 instructions vLLM's default is bfloat16,
            # where a replica verifying other drafts rounds otherwise and flips greedy near-ties.
            "--dtype",
            "float32",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--speculative-config",
            json.dumps(speculative_config(K)),
            "--additional-config",
            json.dumps({"draftcache": {"target": f"127.0.0.1:{service_port}", "namespace": namespace, "near": near}}),
        ]
        # Each replica computes on a core of its own (by default every vLLM binds the first).
        bound = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **bound, **(env or {})}, cwd=CHECKOUT
            )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the vLLM server exited:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def chat(self, question: str, model: Path, max_tokens: int) -> tuple[str, float]:
        """The greedy answer and how long it took."""
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        request = urllib.request.Request(
            self.url("/v1/chat/completions"), json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.monotonic()
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer = json.loads(reply.read())
        return answer["choices"][0]["message"]["content"], time.monotonic() - start

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as reply:
            return str(reply.read().decode())

    def spec_counters(self) -> dict[str, float]:
        """The spec-decode counters of /metrics (name without ``vllm:`` and ``_total``)."""
        text = self.metrics()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:spec_decode_num_") and "_total" in line and "per_pos" not in line:
                name = line.split("{")[0].split(" ")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(params=[False, True], ids=["through-the-service", "near"])
def replicas(
    model_folder: Path, serve: Serve, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[list[ApiServer]]:
    cores = max(1, os.cpu_count() or 1)
    near = bool(request.param)
    # A namespace of the test's own: the module's service keeps what other tests answered, which
    # a near copy would read at start (replica 1 would then know the answer too).
    namespace = f"{NAMESPACE}-replicas-{request.param_index}"
    servers = [
        ApiServer(model_folder, serve.port, i % cores, tmp_path / f"vllm-{i}.log", near, namespace) for i in range(2)
    ]
    try:
        for s in servers:
            wait_for(s.ready, 900, "a vLLM server to be ready", every_s=1.0)
        yield servers
    finally:
        for s in servers:
            s.stop()


def per_draft(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    return {"drafts": drafts, "accepted_tokens": accepted, "accepted_per_draft": accepted / drafts if drafts else 0.0}


def test_replica_two_drafts_from_what_replica_one_answered(replicas: list[ApiServer], model_folder: Path) -> None:
    one, two = replicas
    before = one.spec_counters()
    answer_one, seconds_one = one.chat(QUESTION, model_folder, 160)
    first = per_draft(before, one.spec_counters())
    # Replica 1's proposer closes the finished request (idle, 2 s) and commits it; a near copy on
    # replica 2 reads it from the service's log within a second more.
    time.sleep(5)
    before = two.spec_counters()
    answer_two, seconds_two = two.chat(QUESTION, model_folder, 160)
    second = per_draft(before, two.spec_counters())
    print(
        json.dumps(
            {
                "replica_1": {**first, "seconds": round(seconds_one, 2)},
                "replica_2": {**second, "seconds": round(seconds_two, 2)},
            }
        )
    )
    assert answer_two == answer_one  # greedy: the same answer on both replicas
    assert first["drafts"] > 0 and second["drafts"] > 0
    # Replica 2 drafts the answer it has never seen from replica 1's commit.
    assert second["accepted_per_draft"] > first["accepted_per_draft"]


def test_a_replica_that_joins_later_drafts_what_the_fleet_answered(
    model_folder: Path, serve: Serve, tmp_path: Path
) -> None:
    # Near copies: replica 2 starts only after replica 1 answered; its near copy reads the
    # service's log at start, so it begins with that answer in its memory.
    cores = max(1, os.cpu_count() or 1)
    namespace = f"{NAMESPACE}-joins-later"  # of its own (see the replicas fixture)
    one = ApiServer(model_folder, serve.port, 0, tmp_path / "vllm-1.log", near=True, namespace=namespace)
    two: ApiServer | None = None
    try:
        wait_for(one.ready, 900, "a vLLM server to be ready", every_s=1.0)
        before = one.spec_counters()
        answer_one, seconds_one = one.chat(QUESTION, model_folder, 160)
        first = per_draft(before, one.spec_counters())
        time.sleep(5)  # replica 1's proposer closes the finished request (idle, 2 s) and commits it
        two = ApiServer(model_folder, serve.port, 1 % cores, tmp_path / "vllm-2.log", near=True, namespace=namespace)
        wait_for(two.ready, 900, "a vLLM server to be ready", every_s=1.0)
        before = two.spec_counters()
        answer_two, seconds_two = two.chat(QUESTION, model_folder, 160)
        second = per_draft(before, two.spec_counters())
        print(json.dumps({"replica_1": {**first, "seconds": round(seconds_one, 2)},
                          "replica_2_joined_later": {**second, "seconds": round(seconds_two, 2)}}))  # fmt: skip
        assert answer_two == answer_one
        assert first["drafts"] > 0 and second["drafts"] > 0
        assert second["accepted_per_draft"] > first["accepted_per_draft"]
    finally:
        one.stop()
        if two is not None:
            two.stop()

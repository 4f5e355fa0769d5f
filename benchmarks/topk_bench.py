"""``draftcache bench-topk``: what the target's own top-k, written back, adds to the drafts.

The reference decoder generates greedily with the real model, drafting from our engine in
process, and verifies every tree whole (no cost cut: nothing here hangs on timings, so a run
gives the same numbers on any machine). Three engines run the same prompts, each learning only
from its own run: the target's top-k fed to the successor tier at every node a step verified
(rejected ones included: what a decoder holds anyway, Token Recycling's adjacency), at the
positions that produced the step's tokens only (what a trace replay can feed), or nowhere. MAT
(tokens per verification step) per workload; greedy outputs are the same for all three.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from benchmarks.generate import InProcessDrafter
from benchmarks.generate_bench import TOPK_AT, BenchConfig, Prompt, encode, topk_feed, workload
from decoder_client.reference_decoder import ReferenceDecoder
from indexer.drafter import MAX_LOOKAHEAD, DrafterConfig, DraftParams, NamespaceDrafter
from indexer.tokens import Namespace

logger = logging.getLogger(__name__)


@dataclass
class Feed:
    """One engine's run: tokens and verification steps per workload."""

    tokens: dict[str, int]
    steps: dict[str, int]
    outputs: list[list[int]]
    ahead_hits: int = 0  # steps that verified a tree drafted ahead for their outcome
    ahead_steps: int = 0  # steps after one that drafted ahead

    def mat(self, name: str) -> float:
        return self.tokens[name] / self.steps[name]


def topk_params(budget: int, chain: int, lookahead: int) -> DraftParams:
    """The drafts' settings, checked (``ValueError``) before any decoding starts."""
    if not 0 <= lookahead <= MAX_LOOKAHEAD:
        raise ValueError(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {lookahead}")
    return DraftParams(budget=budget, chain=chain)


def run_feed(
    model: Any,
    prompts: list[tuple[Prompt, list[int]]],
    config: BenchConfig,
    prior: Any,
    eos: int | None,
    at: str,
    params: DraftParams,
    *,
    lookahead: int = 0,
) -> Feed:
    """Every prompt in order through one engine fed the target's top-k ``at`` (see
    :data:`~benchmarks.generate_bench.TOPK_AT`), each finished request joining its memory.
    ``params`` with a chain: chains of at most that many tokens are drafted and verified (what
    engines take) instead of whole trees, and every chain position's row is a verified node's.
    ``lookahead`` > 0: trees drafted ahead for that many outcomes of each step (counted in
    ``ahead_hits`` where the outcome had one)."""
    vocab = int(model.config.get_text_config().vocab_size)
    engine = NamespaceDrafter(Namespace(name="topk", vocab_size=vocab), DrafterConfig(), prior)
    decoder = ReferenceDecoder(model)
    topk, every_node = topk_feed(at)
    feed = Feed({}, {}, [])
    for prompt, ids in prompts:
        drafter = InProcessDrafter(vocab, params, engine=engine, every_node=every_node, lookahead=lookahead)
        out, stats = decoder.generate(ids, config.max_new_tokens, drafter=drafter, eos_token_id=eos, topk=topk)
        drafter.close(commit=True)
        feed.ahead_hits += drafter.ahead_hits
        feed.ahead_steps += drafter.ahead_steps
        if engine.memory.needs_rebuild():
            engine.memory.rebuild()
        for name in (workload(prompt), "all"):
            feed.tokens[name] = feed.tokens.get(name, 0) + stats.new_tokens
            feed.steps[name] = feed.steps.get(name, 0) + stats.steps
        feed.outputs.append(out)
        logger.info("%s %s %s: MAT %.2f", at, prompt.category, prompt.name, stats.mat)
    return feed


def bench_topk(
    model: Any,
    tokenizer: Any,
    prompts: list[Prompt],
    config: BenchConfig,
    prior: Any = None,
    *,
    chain: int = 0,
    lookahead: int = 0,
) -> dict:
    """MAT per workload for each feed, its ratio to no feed, and whether outputs agree (trees,
    or with ``chain`` chains of at most that many tokens); with ``lookahead`` each feed's
    pre-speculation hit rate too."""
    params = topk_params(config.budget, chain, lookahead)
    encoded = [(p, encode(tokenizer, p)) for p in prompts]
    eos = tokenizer.eos_token_id
    feeds = {at: run_feed(model, encoded, config, prior, eos, at, params, lookahead=lookahead) for at in TOPK_AT}
    none = feeds["none"]
    names = [n for n in none.tokens if n != "all"] + ["all"]
    return {
        "mat": {at: {n: round(f.mat(n), 4) for n in names} for at, f in feeds.items()},
        "ratio_to_none": {at: {n: round(f.mat(n) / none.mat(n), 4) for n in names} for at, f in feeds.items()},
        "identical": all(f.outputs == none.outputs for f in feeds.values()),
        "prompts": len(prompts),
        "chain": chain,
        "lookahead": lookahead,
        "prespeculation_hit_rate": {
            at: round(f.ahead_hits / f.ahead_steps, 4) if f.ahead_steps else None for at, f in feeds.items()
        },
        "tokens": {n: none.tokens[n] for n in names},
    }


def report(result: dict) -> str:
    names = list(result["tokens"])
    lines = [f"{'top-k fed at':<14}" + "".join(f"{n:>22}" for n in names)]
    for at, mats in result["mat"].items():
        ratios = result["ratio_to_none"][at]
        lines.append(f"{at:<14}" + "".join(f"{mats[n]:>13.3f} ({ratios[n]:.3f}x)" for n in names))
    if result["lookahead"]:
        rates = result["prespeculation_hit_rate"]
        lines.append(
            f"pre-speculation ({result['lookahead']} outcomes ahead), hit rate: "
            + ", ".join(f"{at} {rate:.1%}" for at, rate in rates.items() if rate is not None)
        )
    drafts = f"chains of at most {result['chain']}" if result["chain"] else "whole trees"
    lines.append(
        f"{result['prompts']} prompts, {drafts}, tokens {result['tokens']}, outputs identical: {result['identical']}"
    )
    return "\n".join(lines)

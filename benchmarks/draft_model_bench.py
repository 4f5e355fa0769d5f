"""What a draft model beside the cache costs an engine's step at a batch: the batch's rows read
together (one forward per depth, :mod:`decoder_client.draft_model`) against one request after
another, side by side on the same rows.

Each row is a request: a real prompt, then the steps' text. A step reads every row's new tokens
and drafts a chain of ``k`` after it, as an engine's proposer does where the model's chain goes
for every row; the row's context then takes the first ``accept`` tokens of its chain and one
token the chain did not propose (the target's own, where verification stopped), so every step
reads ``accept + 1`` tokens a row and rewinds the rest. With ``going`` only that many rows a
step (in turn) go on past their first token, as where the cache's chain goes for the others;
those others take one token their model did not propose. Both ways read the same rows to the same
chains (checked: the report says whether every chain agreed). The modes alternate step by step,
each on rows of its own, so a noisy host weighs on both alike; the report gives each mode's
median and p90 step time per batch size, and their ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from decoder_client.chain_model import ChainModel, extend_many, first_many


@dataclass(frozen=True, kw_only=True)
class DraftModelBenchConfig:
    batches: tuple[int, ...] = (1, 2, 4, 8)
    k: int = 8
    accept: int = 3  # tokens of each chain the target takes a step
    steps: int = 24  # timed steps per batch size and mode
    prompt_tokens: int = 512  # each prompt cut to at most this
    going: int | None = None  # rows a step whose chain goes on past its first token (None: all)

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or self.steps < 1 or self.prompt_tokens < 1:
            raise ValueError("batches, steps and prompt_tokens must be >= 1")
        if self.going is not None and not 0 <= self.going <= min(self.batches):
            raise ValueError(f"going must be in [0, the smallest batch {min(self.batches)}], got {self.going}")
        if not 0 <= self.accept < self.k:
            raise ValueError(f"accept must be in [0, k), got {self.accept} with k {self.k}")


def run_draft_model_bench(
    make: Callable[[], ChainModel], prompts: Sequence[np.ndarray], config: DraftModelBenchConfig
) -> dict:
    """Time ``config.steps`` steps of each batch size, together and one by one, over drafters
    made by ``make`` (all over one model). ``prompts`` are int32 ids, at least the largest batch."""
    if len(prompts) < max(config.batches):
        raise ValueError(f"{len(prompts)} prompts for a batch of {max(config.batches)}")
    out: dict = {"k": config.k, "accept": config.accept, "steps": config.steps, "going": config.going, "batches": {}}
    same = True
    for b in config.batches:
        rows = {mode: [make() for _ in range(b)] for mode in ("together", "alone")}
        contexts = {mode: [p[: config.prompt_tokens].copy() for p in prompts[:b]] for mode in rows}
        seconds: dict[str, list[float]] = {mode: [] for mode in rows}
        n = b if config.going is None else config.going
        for step in range(config.steps + 1):  # the first step reads the prompts: not timed
            going = {(step * n + j) % b for j in range(n)}
            chains = {}
            for mode in rows:
                start = time.perf_counter()
                chains[mode] = _step(rows[mode], contexts[mode], going, together=mode == "together")
                if step:
                    seconds[mode].append(time.perf_counter() - start)
            same &= all(np.array_equal(a, c) for a, c in zip(chains["together"], chains["alone"], strict=True))
            for mode in rows:
                vocab = rows[mode][0].vocab_size
                contexts[mode] = [
                    np.concatenate([ctx, chain[: config.accept], [(int(chain[config.accept]) + 1) % vocab]]).astype(
                        np.int32
                    )
                    if chain.size > 1
                    else np.append(ctx, np.int32((int(chain[0]) + 1) % vocab))
                    for ctx, chain in zip(contexts[mode], chains[mode], strict=True)
                ]
        t, a = np.array(seconds["together"]) * 1e3, np.array(seconds["alone"]) * 1e3
        out["batches"][b] = {
            "together_ms_p50": round(float(np.median(t)), 1),
            "together_ms_p90": round(float(np.percentile(t, 90)), 1),
            "alone_ms_p50": round(float(np.median(a)), 1),
            "alone_ms_p90": round(float(np.percentile(a, 90)), 1),
            "alone_over_together": round(float(np.median(a) / np.median(t)), 2),
        }
    out["chains_agree"] = same
    return out


def _step(rows: list[ChainModel], contexts: list[np.ndarray], going: set[int], *, together: bool) -> list[np.ndarray]:
    """Every row's chain after its context (its first token alone for a row not ``going``), read
    as one batch or one row after another."""
    if together:
        firsts = first_many(rows, contexts)
        on = sorted(going)
        chains = dict(zip(on, (t for t, _ in extend_many([rows[i] for i in on], 0.0)), strict=True))
    else:
        firsts = [row.first(ctx) for row, ctx in zip(rows, contexts, strict=True)]
        chains = {i: rows[i].extend()[0] for i in sorted(going)}
    out = []
    for i, f in enumerate(firsts):
        if f is None:
            raise ValueError(f"row {i}: its context and a chain do not fit the model's positions")
        out.append(chains[i] if i in chains else np.array([f.token], np.int32))
    return out

"""The draft path on its own: the service's batched draft call, in process, stepping batches of
real sequences the way bench-load's decoders do, with no transport, storage or other process
sharing the CPU.

Each step drafts for every sequence of the batch (sending the tokens produced since its last
step), judges the accepted length against the recorded continuation, and replaces the requests
that finished (closed with commit, so the lifetime memory fills as it would in service); the
lifetime indexes are rebuilt every ``rebuild_every`` steps. ``step_interval_s`` stands for the
target's verification time, as in bench-load: the next step starts that long after the last draft
returned, the process idle meanwhile. On a shared host a sequence-draft then costs more than back
to back (the caches and predictors the draft path warmed are partly lost while it waits); the
trees stay the same.

Reports the time one sequence-draft takes (a batch call's time over its size), the time finishing
and opening requests adds per sequence-draft (indexing the finished ones included), the rebuilds'
time, and a digest of every tree, so two builds can be compared side by side and checked to draft
the same trees.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.load_bench import Replayed, requests_of
from benchmarks.traces import Conversation
from cache_service.config import ServiceConfig
from cache_service.domain.service import CloseItem, DraftItem, DraftService, FeedbackItem, OpenItem
from indexer.drafter import MAX_LOOKAHEAD, DrafterConfig, DraftParams
from indexer.prior import StaticPrior
from indexer.tokens import Namespace


@dataclass(frozen=True, kw_only=True)
class DraftBenchConfig:
    batch: int = 32
    steps: int = 1200
    rebuild_every: int = 300  # steps between lifetime index rebuilds (0: never)
    lookahead: int = 0  # pre-speculation: outcomes each step drafts ahead for
    step_interval_s: float = 0.0  # idle time from a draft's return to the next step (the verification)
    params: DraftParams = field(default_factory=DraftParams)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.steps < 1 or self.rebuild_every < 0 or self.step_interval_s < 0:
            raise ValueError("batch and steps must be >= 1, rebuild_every and step_interval_s >= 0")
        if not 0 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {self.lookahead}")


def run_draft_bench(
    conversations: list[Conversation], namespace: Namespace, config: DraftBenchConfig, prior: StaticPrior | None = None
) -> dict:
    """Step ``config.steps`` batches; per-sequence draft time (us), MAT and the trees' digest.
    With ``prior`` the namespace drafts from that static prior too."""
    service = DraftService(ServiceConfig(default_params=config.params, drafter=config.drafter))
    service.create_namespace(namespace.name, namespace.vocab_size)
    if prior is not None:
        service.set_prior(namespace.name, prior, 1)
    source = requests_of(conversations)  # every output segment once, then again (no end)

    def open_many(count: int) -> list[Replayed[str]]:
        requests = [next(source) for _ in range(count)]
        ids = service.open([OpenItem(namespace.name, prompt) for prompt, _ in requests])
        return [Replayed(sid, output) for sid, (_, output) in zip(ids, requests, strict=True)]

    slots = open_many(config.batch)
    digest = hashlib.sha256()
    per_sequence: list[float] = []
    produced = sequence_steps = finished = 0
    turnover = 0.0  # seconds spent finishing and opening requests
    draft_cpu = 0.0  # CPU seconds of the draft calls (less disturbed by other processes than wall time)
    rebuilds: list[float] = []
    for step in range(config.steps):
        items = [DraftItem(s.handle, np.array(s.pending, dtype=np.int32), config.lookahead) for s in slots]
        began, cpu = time.perf_counter(), time.process_time()
        results = service.draft_ahead(items)
        answered = time.perf_counter()
        per_sequence.append((answered - began) / len(items))
        draft_cpu += time.process_time() - cpu
        still: list[Replayed[str]] = []
        done: list[Replayed[str]] = []
        for slot, (tree, _) in zip(slots, results, strict=True):
            for part in (tree.tokens, tree.parents, tree.sources):
                digest.update(part.tobytes())
            produced += slot.verify(tree)
            sequence_steps += 1
            (done if slot.finished else still).append(slot)
        if done:  # the last tokens go in, the requests commit, and the next ones open
            began = time.perf_counter()
            service.feedback([FeedbackItem(d.handle, d.pending) for d in done])
            for job in service.close([CloseItem(d.handle) for d in done]):
                job()
            finished += len(done)
            still.extend(open_many(len(done)))
            turnover += time.perf_counter() - began
        slots = still
        if config.rebuild_every and (step + 1) % config.rebuild_every == 0:
            began = time.perf_counter()
            service.namespace(namespace.name).memory.rebuild()
            rebuilds.append(time.perf_counter() - began)
        if config.step_interval_s:
            time.sleep(max(0.0, answered + config.step_interval_s - time.perf_counter()))
    us = np.array(per_sequence) * 1e6
    c = service.namespace(namespace.name).counters
    return {
        "batch": config.batch,
        "steps": config.steps,
        "step_interval_ms": config.step_interval_s * 1e3,
        "draft_us_per_sequence_p50": round(float(np.percentile(us, 50)), 1),
        "draft_us_per_sequence_p99": round(float(np.percentile(us, 99)), 1),
        "draft_us_per_sequence_mean": round(float(us.mean()), 1),
        "draft_cpu_us_per_sequence": round(draft_cpu * 1e6 / max(1, sequence_steps), 1),
        # opening, feeding back and committing requests, over every sequence-draft
        "turnover_us_per_sequence": round(turnover * 1e6 / max(1, sequence_steps), 1),
        "rebuild_ms_mean": round(float(np.mean(rebuilds)) * 1e3, 1) if rebuilds else 0.0,
        "mat": round(produced / max(1, sequence_steps), 4),
        # outcomes a tree had been drafted ahead for, of those verified (lookahead only)
        "ahead_hit_rate": round(c.ahead_hits / max(1, c.ahead_hits + c.ahead_misses), 4) if config.lookahead else None,
        "requests_finished": finished,
        "trees_sha256": digest.hexdigest()[:16],
    }

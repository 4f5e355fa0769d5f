"""Index benchmark: rebuild time, lookup latency and memory per token at a given buffer size,
on real corpus tokens (requests = corpus documents, queries = held-out documents).

Then the rebuilds a busy service makes with the buffer full: rounds of held-out documents
(``delta_tokens`` each, the delta that calls a rebuild) committed, the ring overwriting its
oldest requests, and the indexes rebuilt by extending the last generation, each round timed
beside sorting the same buffer afresh."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from cache_service.admin.warm import split_documents
from indexer.lifetime_index import LifetimeConfig, LifetimeMemory, build_indexes, build_table
from indexer.ngram_table import NgramTableConfig


@dataclass(frozen=True, kw_only=True)
class IndexBenchConfig:
    buffer_tokens: int = 10_000_000
    queries: int = 20_000
    context: int = 64  # tokens of context per query
    max_match: int = 32
    depth: int = 32
    samples: int = 32
    table: NgramTableConfig = field(default_factory=NgramTableConfig)
    delta_tokens: int = LifetimeConfig().delta_max_tokens  # new tokens per extending rebuild
    rounds: int = 5  # extending rebuilds timed (0: none)

    def __post_init__(self) -> None:
        if self.buffer_tokens < 1000 or self.queries < 1 or self.context < 1:
            raise ValueError("buffer_tokens >= 1000, queries >= 1 and context >= 1 required")
        if self.delta_tokens < 1 or self.rounds < 0:
            raise ValueError("delta_tokens >= 1 and rounds >= 0 required")


def run_index_bench(corpus: np.ndarray, config: IndexBenchConfig) -> dict:
    docs = split_documents(corpus)
    loaded, used = [], 0
    for doc in docs:
        if used + doc.size + 1 > config.buffer_tokens:
            break
        loaded.append(doc)
        used += doc.size + 1
    held_out = np.concatenate(docs[len(loaded) :] or [corpus[-config.context * 4 :]])
    if held_out.size <= config.context:
        raise ValueError("the corpus is too small for the requested buffer: nothing left to query with")
    memory = LifetimeMemory(LifetimeConfig(capacity_tokens=used + 1, table=config.table, delta_max_tokens=max(1, used)))
    memory.commit_many(loaded)
    start = time.perf_counter()
    built = memory.rebuild()
    rebuild_s = time.perf_counter() - start
    index = built.suffix
    rng = np.random.default_rng(0)
    ends = rng.integers(config.context, held_out.size, size=config.queries)
    lat, found = np.empty(config.queries), 0
    for i, end in enumerate(ends.tolist()):
        ctx = held_out[end - config.context : end]
        t0 = time.perf_counter()
        n, first, last = index.longest_match(ctx, config.max_match)
        if n:
            index.continuations(first, last, n, config.depth, config.samples)
            found += 1
        lat[i] = time.perf_counter() - t0
    t_lat = np.empty(min(config.queries, 5000))
    for i, end in enumerate(ends[: t_lat.size].tolist()):
        ctx = held_out[end - config.context : end]
        t0 = time.perf_counter()
        built.table.lookup(ctx)
        t_lat[i] = time.perf_counter() - t0
    out = {
        "buffer_tokens": int(index.size),
        "requests": len(loaded),
        "rebuild_s": round(rebuild_s, 3),
        "index_bytes_per_token": round(built.nbytes / index.size, 2),
        "suffix_bytes_per_token": round(index.nbytes / index.size, 2),
        "table_bytes_per_token": round(built.table.nbytes / index.size, 2),
        "table_leaders": built.table.leaders,
        "lookup_us_p50": round(float(np.percentile(lat, 50)) * 1e6, 1),
        "lookup_us_p99": round(float(np.percentile(lat, 99)) * 1e6, 1),
        "table_lookup_us_p50": round(float(np.percentile(t_lat, 50)) * 1e6, 1),
        "table_lookup_us_p99": round(float(np.percentile(t_lat, 99)) * 1e6, 1),
        "queries_matched": round(found / config.queries, 3),
    }
    if config.rounds:
        out |= _extending_rounds(memory, docs[len(loaded) :], config)
    return out


def _extending_rounds(memory: LifetimeMemory, docs: list[np.ndarray], config: IndexBenchConfig) -> dict:
    """Commit ``delta_tokens`` of documents per round and rebuild, timing the extending rebuild
    (its table carried over unless due) beside sorting the same buffer afresh, and the table's
    own build (what a rebuild adds once the table is due)."""
    extend, afresh, tables = [], [], []
    at = 0
    for _ in range(config.rounds):
        batch, size = [], 0
        while at < len(docs) and size < config.delta_tokens:
            batch.append(docs[at])
            size += docs[at].size + 1
            at += 1
        if size < config.delta_tokens:
            break  # the corpus ran out
        memory.commit_many(batch)
        start = time.perf_counter()
        built = memory.rebuild()
        extend.append(time.perf_counter() - start)
        if not built.extended:
            raise RuntimeError("a rebuild of a full buffer did not extend the last generation")
        tokens, sa = built.suffix.tokens, built.suffix.suffix_array
        start = time.perf_counter()
        build_indexes(tokens, config.table, built.version)
        afresh.append(time.perf_counter() - start)
        start = time.perf_counter()
        build_table(tokens, sa, config.table)
        tables.append(time.perf_counter() - start)
    if not extend:
        return {}
    ext, full = np.array(extend), np.array(afresh)
    return {
        "extend_rounds": ext.size,
        "extend_delta_tokens": config.delta_tokens,
        "extend_s_median": round(float(np.median(ext)), 3),
        "afresh_s_median": round(float(np.median(full)), 3),
        "extend_over_afresh_median": round(float(np.median(ext / full)), 4),
        "table_build_s_median": round(float(np.median(tables)), 3),
    }

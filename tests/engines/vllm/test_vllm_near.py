"""draftcache drafting near (the default), inside real vLLM: every draft made in vLLM's worker
from the near copy (its prior read from the service, as published there), greedy outputs
identical to plain vLLM, and every request still committed to the service's lifetime log."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

from cache_service.host.embedded_redis import free_port
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from tests.engines.vllm.conftest import (
    NAMESPACE,
    assert_committed_once,
    drafting_kwargs,
    generate,
    make_llm,
    shutdown,
    spec_counters,
    wait_stats,
)
from tests.faults import Serve

NEAR_NAMESPACE = NAMESPACE + "-near"  # a prior of its own, published to the service: no other test drafts with it


def test_a_near_copy_drafts_in_vllms_worker_and_commits_every_request(
    model_folder: Path, serve: Serve, chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    copy, code, planets, capital = chat_prompts
    batch = [(copy, 64), (code, 40), (planets, 48), (capital, 12)]
    llm = make_llm(model_folder)
    try:
        plain = generate(llm, batch)
    finally:
        shutdown(llm)
    # A prior as 'draftcache warm' publishes one, from text like the answers (each twice: a
    # prior keeps what its corpus repeats): the planets' answer, which nothing in its prompt
    # foretells. The near copy reads it from the service before its first request.
    from indexer.prior import PriorConfig, StaticPrior

    corpus = np.array([*plain[2], 0] * 2, dtype=np.int32)
    vocab = json.loads((model_folder / "config.json").read_text())["vocab_size"]
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NEAR_NAMESPACE, vocab_size=vocab))
    version = RedisStore(connect(serve.redis_url())).put_prior(
        NEAR_NAMESPACE, StaticPrior.build(corpus, PriorConfig()).to_bytes()
    )
    stats_path = tmp_path / "stats.json"
    port = free_port()  # the client's counts, served from vLLM's worker
    kwargs = drafting_kwargs(serve, stats_path, namespace=NEAR_NAMESPACE, metrics_port=port)  # near: the default
    llm = make_llm(model_folder, **kwargs)
    try:
        before = spec_counters(llm)
        assert generate(llm, batch) == plain
        after = spec_counters(llm)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        shutdown(llm)
    drafts = {
        s.labels["source"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "draftcache_client_drafts_total"
        and s.labels == {"engine": "vllm", "namespace": NEAR_NAMESPACE, "source": s.labels["source"]}
    }
    assert drafts["near"] > 0 and drafts["service"] == drafts["fallback"] == 0, drafts
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert accepted > 0  # vLLM verified the near copy's drafts and kept some
    stats = wait_stats(stats_path, lambda s: s["sessions_closed"] == len(batch), 30, "every request closed")
    assert stats["near_drafts"] > 0 and stats["errors"] == 0
    assert stats["near_prior_version"] == version
    assert stats["remote_drafts"] == stats["fallback_drafts"] == stats["draft_calls"] == 0  # no call on a step
    assert stats["commits_dropped"] == 0
    assert_committed_once(serve, NEAR_NAMESPACE, batch, plain)

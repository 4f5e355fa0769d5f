"""draftcache inside real vLLM as its speculative proposer: greedy outputs identical to plain
vLLM, one session per request whatever vLLM does to its batch, finished requests in the
service's lifetime log, and the service frozen or killed mid-generation."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from tests.engines.vllm.conftest import (
    NAMESPACE,
    K,
    drafting_kwargs,
    generate,
    make_llm,
    read_stats,
    shutdown,
    spec_counters,
    wait_stats,
)
from tests.faults import Serve, log_entries, wait_for

Requests = list[tuple[list[int], int]]
SMOLLM2_TOKENIZER = "9f9b052c2dfc9277"  # its fingerprint (indexer.fingerprint)


@pytest.fixture(scope="module")
def batch(chat_prompts: list[list[int]]) -> Requests:
    """One batch: answers cut at different lengths (rows finish at different steps, so vLLM
    condenses its batch) and the same question twice (identical rows side by side)."""
    copy, code, planets, capital = chat_prompts
    return [(copy, 72), (code, 40), (capital, 12), (planets, 56), (code, 40)]


@pytest.fixture(scope="module")
def long_batch(chat_prompts: list[list[int]]) -> Requests:
    copy, code, planets, _ = chat_prompts
    return [(copy, 160), (code, 160), (planets, 160)]


@pytest.fixture(scope="module")
def plain(model_folder: Path, batch: Requests, long_batch: Requests) -> dict[str, list[list[int]]]:
    """Plain vLLM's greedy outputs (the engine is shut down before the drafting one starts)."""
    llm = make_llm(model_folder)
    try:
        return {"batch": generate(llm, batch), "long": generate(llm, long_batch)}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def drafting(
    model_folder: Path, serve: Serve, tmp_path_factory: pytest.TempPathFactory, plain: dict[str, Any]
) -> Iterator[tuple[Any, Path]]:
    """vLLM with draftcache as its proposer (started after ``plain``: one engine at a time),
    drafting through the service (its calls, sessions and faults are what these tests are
    about; tests/engines/vllm/test_vllm_near.py drafts near, the default), and the proposer's
    stats file."""
    stats = tmp_path_factory.mktemp("proposer") / "stats.json"
    llm = make_llm(model_folder, **drafting_kwargs(serve, stats, near=False))
    yield llm, stats
    shutdown(llm)


def test_an_engine_on_a_namespace_of_another_vocabulary_generates_as_plain_vllm_and_commits_nothing(
    model_folder: Path, serve: Serve, batch: Requests, plain: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    """A namespace another tokenizer's fleet keeps (a larger vocabulary: every id of this model
    lies in it, and means other text there): the proposer, drafting near (the default), drafts
    from its own requests, follows nothing of the namespace and commits nothing into it. First
    in the module: its engine runs and ends before the module's drafting one starts."""
    name = NAMESPACE + "-another-tokenizer"
    vocab = json.loads((model_folder / "config.json").read_text())["vocab_size"]
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=name, vocab_size=vocab + 16384), timeout=10)
    stats_path = tmp_path / "stats.json"
    llm = make_llm(model_folder, **drafting_kwargs(serve, stats_path, namespace=name))
    try:
        assert generate(llm, batch) == plain["batch"]
        wait_stats(stats_path, lambda s: s["sessions_closed"] == len(batch), 30, "every request closed")
    finally:
        shutdown(llm)
    assert log_entries(serve.redis_url(), name) == []
    stats = read_stats(stats_path)  # as the idle engine last wrote it
    assert stats["near_drafts"] > 0 and stats["errors"] == 0
    assert stats["near_followed"] == 0 and stats["near_prior_version"] == 0
    assert stats["commits_dropped"] == len(batch) and stats["commits_pending"] == 0


def test_greedy_outputs_identical_to_plain_vllm(
    drafting: tuple[Any, Path], serve: Serve, batch: Requests, plain: dict[str, list[list[int]]]
) -> None:
    llm, stats_path = drafting
    before = spec_counters(llm)
    assert generate(llm, batch) == plain["batch"]
    after = spec_counters(llm)
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert drafted > 0 and accepted > 0  # vLLM verified our drafts and kept some
    stats = wait_stats(stats_path, lambda s: s["steps"] > 0, 10, "the proposer's stats")
    assert stats["remote_drafts"] > 0  # drafts came from the service, not only the local fallback
    assert stats["errors"] == 0
    # The proposer stated vLLM's tokenizer with its namespace: the fingerprint draftcache warm
    # and llama.cpp state for SmolLM2's (tests/client/test_fingerprints.py).
    listed = serve.admin.Namespaces(pb.NamespacesRequest(), timeout=10).namespaces
    assert [n.tokenizer for n in listed if n.name == NAMESPACE] == [SMOLLM2_TOKENIZER]


def test_each_request_is_one_session_committed_whole(
    drafting: tuple[Any, Path], serve: Serve, batch: Requests, plain: dict[str, list[list[int]]]
) -> None:
    """After the batch above (rows finishing at different steps, rows moved by vLLM, two
    identical rows), the service's lifetime log holds each request's prompt and output, once."""
    _, stats_path = drafting
    stats = wait_stats(stats_path, lambda s: s["sessions_live"] == 0, 30, "the idle engine's sessions to close")
    assert stats["sessions_opened"] == len(batch)  # no request was split over two sessions
    assert stats["rows_moved"] > 0  # vLLM did move rows: the case this test is about
    wait_for(lambda: len(log_entries(serve.redis_url(), NAMESPACE)) >= len(batch), 30, "the commits")
    entries = log_entries(serve.redis_url(), NAMESPACE)
    expected = [prompt + out for (prompt, _), out in zip(batch, plain["batch"], strict=True)]
    assert len(entries) == len(expected)
    for entry in entries:
        # The last step may have produced a few tokens past max_tokens (accepted drafts that
        # vLLM then drops from the output): at most K more.
        owners = [e for e in expected if entry[: len(e)] == e and len(entry) - len(e) <= K]
        assert owners, f"a committed sequence that is no request's: {entry}"
        expected.remove(owners[0])
    assert expected == []


def _generate_through(
    fault: Callable[[], None], llm: Any, stats_path: Path, long_batch: Requests, plain: dict[str, list[list[int]]]
) -> dict[str, Any]:
    """The long batch generated with ``fault`` done to the service after ten drafting steps:
    vLLM runs to the end with plain greedy's tokens, the local drafter answering, and no step
    waits on the service past the client's deadlines. The proposer's stats after it."""
    wait_stats(stats_path, lambda s: s["sessions_live"] == 0, 30, "earlier sessions to close")
    before = read_stats(stats_path)
    out: list[list[list[int]]] = []
    worker = threading.Thread(target=lambda: out.append(generate(llm, long_batch)))
    started = time.monotonic()
    worker.start()
    wait_stats(stats_path, lambda s: s["steps"] >= before["steps"] + 10, 300, "ten drafting steps")
    fault()
    worker.join(timeout=600)
    assert not worker.is_alive(), "vLLM stalled after the fault"
    assert out == [plain["long"]]  # still plain greedy's tokens
    stats = wait_stats(stats_path, lambda s: s["sessions_live"] == 0, 30, "the sessions to close")
    assert stats["fallback_drafts"] > before["fallback_drafts"] and stats["failed_calls"] > before["failed_calls"]
    # No step waited on the service past the client's deadlines (a stuck call would take the
    # control timeout, 1 s, or forever).
    assert stats["proposer_ms_max"] < 1000, stats
    assert stats["errors"] == 0
    print(f"generation through the fault took {time.monotonic() - started:.1f} s; proposer {stats}")
    return stats


def _drafts_from_the_service_again(
    llm: Any, stats_path: Path, stats: dict[str, Any], long_batch: Requests, plain: dict[str, list[list[int]]]
) -> None:
    """A service on a busy machine may miss the first steps' deadlines once it is back (the
    fallback answers those), so a few requests in a row are allowed before its drafts must be."""
    remote, closed = stats["remote_drafts"], stats["sessions_closed"]
    for _ in range(4):
        assert generate(llm, long_batch[:1]) == plain["long"][:1]
        closed += 1
        after = wait_stats(stats_path, lambda s, n=closed: s["sessions_closed"] >= n, 30, "the request's close")
        if after["remote_drafts"] > remote:
            break
    assert after["remote_drafts"] > remote, after


def test_service_frozen_mid_generation(
    drafting: tuple[Any, Path], serve: Serve, long_batch: Requests, plain: dict[str, list[list[int]]]
) -> None:
    """SIGSTOP: the service's port still takes connections and calls, and nothing answers them."""
    llm, stats_path = drafting
    try:
        stats = _generate_through(serve.freeze, llm, stats_path, long_batch, plain)
    finally:
        serve.thaw()
    _drafts_from_the_service_again(llm, stats_path, stats, long_batch, plain)


def test_service_killed_mid_generation(
    drafting: tuple[Any, Path], serve: Serve, long_batch: Requests, plain: dict[str, list[list[int]]]
) -> None:
    llm, stats_path = drafting
    stats = _generate_through(serve.sigkill, llm, stats_path, long_batch, plain)
    serve.start()  # back, on the same data
    _drafts_from_the_service_again(llm, stats_path, stats, long_batch, plain)


def test_a_namespace_of_another_vocabulary_is_an_error_with_the_services_reason(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """The proposer creates its namespace at start; where the service holds it with another
    vocabulary (another tokenizer's drafts and memory), that is logged as an error, with the
    service's reason, not as a namespace merely found there."""
    from decoder_client.engines.settings import EngineSettings
    from decoder_client.engines.vllm import ensure_namespace

    name = NAMESPACE + "-other-vocab"
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=name, vocab_size=1000), timeout=10)
    config = EngineSettings(namespace=name, target=f"127.0.0.1:{serve.port}").client_config(K)
    with caplog.at_level(logging.WARNING, logger="decoder_client.engines.vllm"):
        ensure_namespace(config, 49152, timeout_s=10)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR, record.getMessage()
    assert "exists with vocab_size 1000, not 49152" in record.getMessage()


def test_a_namespace_of_another_tokenizer_of_the_same_size_is_an_error(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """The same vocabulary size, another tokenizer's fingerprint registered: an error at start,
    and the service refuses the model's calls there."""
    from decoder_client.engines.settings import EngineSettings
    from decoder_client.engines.vllm import ensure_namespace

    name = NAMESPACE + "-other-tokenizer"
    other = "0123456789abcdef"
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=name, vocab_size=49152, tokenizer=other), timeout=10)
    settings = EngineSettings(namespace=name, target=f"127.0.0.1:{serve.port}")
    config = dataclasses.replace(settings.client_config(K), tokenizer=SMOLLM2_TOKENIZER)
    with caplog.at_level(logging.WARNING, logger="decoder_client.engines.vllm"):
        ensure_namespace(config, 49152, timeout_s=10)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and f"tokenizer {other}, not {SMOLLM2_TOKENIZER}" in record.getMessage()
    ours = pb.OpenSession(namespace=name, prompt=[1, 2, 3], vocab_size=49152, tokenizer=SMOLLM2_TOKENIZER)
    with pytest.raises(grpc.RpcError) as refused:
        serve.stub.OpenSessions(pb.OpenSessionsRequest(sessions=[ours]))
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_a_namespace_of_the_tokenizers_size_which_the_model_pads_is_taken_quietly(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A namespace registered with the tokenizer's size (``draftcache warm`` does) where the
    model's embedding table is padded past it: the same tokenizer, so no error at start, and
    the service serves the model's calls there."""
    from decoder_client.engines.settings import EngineSettings
    from decoder_client.engines.vllm import ensure_namespace

    name = NAMESPACE + "-tokenizer-size"
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=name, vocab_size=49152 - 100), timeout=10)
    config = EngineSettings(namespace=name, target=f"127.0.0.1:{serve.port}").client_config(K)
    with caplog.at_level(logging.INFO, logger="decoder_client.engines.vllm"):
        ensure_namespace(config, 49152, timeout_s=10)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "exists with vocab_size 49052, not 49152" in record.getMessage()
    opened = serve.stub.OpenSessions(
        pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=name, prompt=[1, 2, 3], vocab_size=49152)])
    )
    assert len(opened.session_ids) == 1
    # Stating its tokenizer, the model registers it with the namespace, under the namespace's size.
    config = dataclasses.replace(config, tokenizer=SMOLLM2_TOKENIZER)
    ensure_namespace(config, 49152, timeout_s=10)
    listed = serve.admin.Namespaces(pb.NamespacesRequest(), timeout=10).namespaces
    assert [(n.vocab_size, n.tokenizer) for n in listed if n.name == name] == [(49052, SMOLLM2_TOKENIZER)]

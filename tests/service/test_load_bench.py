"""The load benchmark against a real in-process service: decoder processes, real traces."""

from __future__ import annotations

import gzip
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from benchmarks.load_bench import DecoderResult, LoadConfig, requests_of, run_decoder, run_load, summarise
from benchmarks.rpc_bench import run_rpc_bench
from benchmarks.traces import Conversation, Segment, read_traces, sharegpt_conversations, write_traces
from cache_service.admin import warm
from cache_service.config import ServiceConfig
from indexer.drafter import DraftParams
from tests.service.conftest import eventually, start_service, stop_service


def _conv(*segments: tuple[str, list[int]]) -> Conversation:
    return Conversation("c", "ns", "cat", tuple(Segment(k, np.array(t, dtype=np.int32)) for k, t in segments))


def test_requests_cycle_over_output_segments_with_their_context() -> None:
    conv = _conv(("input", [1, 2]), ("output", [3, 4]), ("input", [5]), ("output", [6, 7]))
    assert len(list(requests_of([conv], passes=2))) == 4  # two passes over two requests
    source = requests_of([conv])
    first, second, again = next(source), next(source), next(source)
    # Each output is a request whose prompt is everything before it.
    assert (first[0].tolist(), first[1].tolist()) == ([1, 2], [3, 4])
    assert (second[0].tolist(), second[1].tolist()) == ([1, 2, 3, 4, 5], [6, 7])
    # The source cycles forever.
    assert again[1].tolist() == [3, 4]


def test_requests_need_an_output() -> None:
    with pytest.raises(ValueError, match="no output segments"):
        next(requests_of([_conv(("input", [1, 2]))]))


def test_summary_counts_and_percentiles() -> None:
    config = LoadConfig(targets=("x",), namespace="ns", traces=Path("t"), decoders=2, batch=4, seconds=2.0)
    a = DecoderResult(steps=2, sequence_drafts=7, fallbacks=1, tokens=16, sequence_steps=8, latencies=[0.001, 0.003])
    b = DecoderResult(steps=1, sequence_drafts=4, fallbacks=0, tokens=4, sequence_steps=4, latencies=[0.002])
    a.seconds = b.seconds = 2.0
    out = summarise(config, [a, b], [], server_drafts=11, elapsed=2.5)
    assert out["steps"] == 3
    assert out["step_ms_p50"] == pytest.approx(2.0)
    a.latencies = [0.0, 0.003]  # a step drafted ahead waits for nothing: the mean shows it, the median not
    out = summarise(config, [a, b], [], server_drafts=11, elapsed=2.5)
    assert out["step_ms_p50"] == pytest.approx(2.0) and out["step_ms_mean"] == pytest.approx(5 / 3, abs=1e-3)
    assert out["sequence_drafts_per_s"] == pytest.approx(5.5)  # 11 remote trees in 2 s
    assert out["fallback_share"] == pytest.approx(1 / 12, abs=1e-4)  # 1 of 3 steps x 4 sequences
    assert out["mat"] == pytest.approx(20 / 12, abs=1e-3)


def test_load_run_against_a_live_service(tmp_path: Path) -> None:
    # Two decoder processes, real requests from a small trace written here.
    rng = np.random.default_rng(0)
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as fh:
        for i in range(6):
            text = rng.integers(0, 50, 40).tolist()
            row = {
                "id": str(i),
                "namespace": "ns",
                "category": "c",
                "segments": [{"kind": "input", "tokens": text}, {"kind": "output", "tokens": text[:20] * 2}],
            }
            fh.write(json.dumps(row) + "\n")
    running = start_service(ServiceConfig())
    try:
        running.service.create_namespace("ns", 64)
        config = LoadConfig(
            targets=(running.target,),
            namespace="ns",
            traces=tmp_path / "t.jsonl.gz",
            decoders=2,
            batch=3,
            seconds=2.0,
            deadline_s=1.0,
            watch_pids=(os.getpid(),),
            passes=0,
        )
        out = run_load(config)
    finally:
        stop_service(running)
    assert out["steps"] > 0 and out["fallback_share"] == 0.0
    assert out["client_failures"] == out["lost_opens"] == 0  # a healthy service: no call missed
    # Every tree the decoders counted was served (and counted) by the service.
    assert out["server_drafts_per_s"] == out["sequence_drafts_per_s"] > 0
    # Outputs repeat their prompts, so drafts are accepted: more than one token per step.
    assert out["mat"] > 1.5
    assert out["requests"] > 6  # finished requests were replaced by new ones
    assert str(os.getpid()) in out["processes"]
    # The decoders' own CPU and the host's are reported: does the load share the server's cores?
    assert out["decoder_cpu_cores"] > 0 and out["decoder_cpu_us_per_sequence_step"] > 0
    assert 0 < out["host_cpu_cores_used"] <= out["host_cores"]


def test_verification_time_follows_each_answer(tmp_path: Path) -> None:
    # A decoder verifies for step_interval_s after its draft is answered: a step lasts the
    # draft's latency plus that (a fixed-rate clock would hide the latency in the interval and
    # keep decoders in lockstep).
    rng = np.random.default_rng(1)
    write_traces(
        [_conv(("input", rng.integers(0, 50, 40).tolist()), ("output", rng.integers(0, 50, 60).tolist()))],
        tmp_path / "t.jsonl.gz",
    )
    running = start_service(ServiceConfig())
    try:
        running.service.create_namespace("ns", 64)
        config = LoadConfig(
            targets=(running.target,), namespace="ns", traces=tmp_path / "t.jsonl.gz", decoders=1, batch=2,
            seconds=0.6, step_interval_s=0.03, deadline_s=1.0, passes=0,
        )  # fmt: skip
        result = run_decoder(config, 0)
    finally:
        stop_service(running)
    assert result.steps >= 5 and result.fallbacks == 0
    # ``started`` is taken as each step begins: from one start to the next, the draft's
    # latency and then the verification time.
    periods = np.diff(result.started)
    latencies = np.array(result.latencies[:-1])
    assert (periods >= latencies + 0.03 - 1e-4).all()
    assert result.steps <= 0.6 / (0.03 + float(np.median(latencies))) + 2


def test_rpc_bench_idle_and_during_rebuilds() -> None:
    running = start_service(ServiceConfig())
    try:
        running.service.create_namespace("ns", 64)
        drafter = running.service.namespace("ns")
        drafter.memory.commit(np.arange(64, dtype=np.int32) % 50)  # something to rebuild
        conv = _conv(("input", list(range(40)) * 3), ("output", list(range(40))))
        out = run_rpc_bench(running.target, "ns", [conv], steps=20, batch=2, during_rebuild=True)
    finally:
        stop_service(running)
    # Both phases measured the same calls; rebuilds really ran during the second.
    assert out["idle"]["draft_stream_batch2"]["p50_ms"] > 0
    assert out["during_rebuild"]["draft_stream_batch1"]["p99_ms"] > 0
    assert out["rebuilds"] >= 1 and out["draft_p99_rebuild_over_idle"] > 0


def test_timeline_reports_each_window() -> None:
    config = LoadConfig(targets=("x",), namespace="ns", traces=Path("t"), batch=2, seconds=4.0, timeline_s=2.0)
    # Steps at 0.5 s and 1 s (fast) then at 2.5 s and 3 s (slow).
    r = DecoderResult(steps=4, sequence_drafts=8, latencies=[0.001, 0.001, 0.004, 0.004], started=[0.5, 1.0, 2.5, 3.0])
    r.seconds = 4.0
    rows = summarise(config, [r], [(1.0, {7: (100.0, 1.0)}), (3.0, {7: (120.0, 2.0)})], server_drafts=8, elapsed=4)[
        "timeline"
    ]
    assert [row["from_s"] for row in rows] == [0.0, 2.0]
    assert [row["step_ms_p50"] for row in rows] == [1.0, 4.0]
    assert [row["sequence_steps_per_s"] for row in rows] == [2.0, 2.0]  # 2 steps x batch 2 per 2 s


def test_server_cpu_per_draft_from_watched_processes() -> None:
    config = LoadConfig(targets=("x",), namespace="ns", traces=Path("t"), batch=2, seconds=4.0, watch_pids=(7, 8))
    r = DecoderResult(steps=4, sequence_drafts=8, latencies=[0.001] * 4, started=[0.5, 1.0, 2.5, 3.0])
    r.seconds = 4.0
    # Over 2 s, process 7 used 1 CPU second and process 8 0.5: 0.75 cores for 2 drafts/s.
    samples = [(1.0, {7: (100.0, 1.0), 8: (50.0, 2.0)}), (3.0, {7: (100.0, 2.0), 8: (50.0, 2.5)})]
    out = summarise(config, [r], samples, server_drafts=8, elapsed=4)
    assert out["processes"]["7"]["cpu_cores_used"] == 0.5 and out["processes"]["8"]["cpu_cores_used"] == 0.25
    assert out["server_cpu_us_per_draft"] == pytest.approx(375_000)
    assert out["drafts_per_server_core_s"] == pytest.approx(2 / 0.75, abs=0.1)
    assert "server_cpu_us_per_draft" not in summarise(config, [r], [], server_drafts=8, elapsed=4)


def test_server_cpu_counts_only_while_decoders_step() -> None:
    """Decoders take seconds to start and the server idles meanwhile: CPU averaged over the
    whole run would make a sequence-draft look cheaper than it is."""
    config = LoadConfig(targets=("x",), namespace="ns", traces=Path("t"), batch=2, seconds=4.0, watch_pids=(7,))
    r = DecoderResult(steps=4, sequence_drafts=8, latencies=[0.001] * 4, started=[0.0, 1.0, 2.0, 3.0])
    r.seconds = 4.0
    # Idle for 6 s of start-up (0.1 CPU s), then a full core for the 4 s of stepping.
    samples = [(0.0, {7: (50.0, 0.0)}), (6.0, {7: (50.0, 0.1)}), (8.0, {7: (50.0, 2.1)}), (10.0, {7: (50.0, 4.1)})]
    stepped = summarise(config, [r], samples, server_drafts=8, elapsed=10, window=(6.0, 10.0))
    assert stepped["processes"]["7"]["cpu_cores_used"] == 1.0
    assert stepped["server_cpu_us_per_draft"] == pytest.approx(500_000)  # 2 drafts/s on a full core
    whole = summarise(config, [r], samples, server_drafts=8, elapsed=10)
    assert whole["processes"]["7"]["cpu_cores_used"] == 0.41  # what the run-long average said
    # Fewer than two samples inside the window: the whole run, rather than nothing.
    short = summarise(config, [r], samples, server_drafts=8, elapsed=10, window=(6.5, 7.5))
    assert short["processes"]["7"]["cpu_cores_used"] == 0.41


def test_decoder_and_host_cpu_over_the_stepping_window() -> None:
    config = LoadConfig(targets=("x",), namespace="ns", traces=Path("t"), batch=2, seconds=4.0)
    a = DecoderResult(steps=4, sequence_steps=8, latencies=[0.001] * 4, started=[0.0, 1.0, 2.0, 3.0])
    b = DecoderResult(steps=4, sequence_steps=8, latencies=[0.001] * 4, started=[0.0, 1.0, 2.0, 3.0])
    a.seconds = b.seconds = 4.0
    a.cpu_seconds, b.cpu_seconds = 1.0, 0.6  # 0.4 cores over 4 s, 100 ms over 16 sequence steps
    # The host idles through start-up, then is busy 1.5 cores while the decoders step.
    host = [(0.0, 10.0), (6.0, 10.3), (8.0, 13.3), (10.0, 16.3)]
    out = summarise(config, [a, b], [], server_drafts=16, elapsed=10, window=(6.0, 10.0), host=host)
    assert out["decoder_cpu_cores"] == 0.4 and out["decoder_cpu_us_per_sequence_step"] == 100_000.0
    assert out["host_cpu_cores_used"] == 1.5 and out["host_cores"] >= 1
    assert "host_cpu_cores_used" not in summarise(config, [a], [], server_drafts=16, elapsed=10)


def test_timeline_needs_watched_pids_for_memory() -> None:
    config = LoadConfig(
        targets=("x",), namespace="ns", traces=Path("t"), batch=1, seconds=2.0, timeline_s=1.0, watch_pids=(7,)
    )
    r = DecoderResult(steps=1, sequence_drafts=1, latencies=[0.001], started=[1.5])
    rows = summarise(config, [r], [(1.2, {7: (50.0, 0.5)})], server_drafts=1, elapsed=2)["timeline"]
    assert rows[1]["rss_mib_7"] == 50.0 and rows[0]["rss_mib_7"] is None


def test_sharegpt_corpus_becomes_requests_never_seen_before(tmp_path: Path, shared_data: Path) -> None:
    corpus = [
        {"id": "a", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "Only an answer, no prompt."}]},  # no request
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Two plus two?"},
                {"from": "gpt", "value": "Four."},
                {"from": "human", "value": "   "},  # blank: left out
                {"from": "human", "value": "And three?"},
                {"from": "gpt", "value": "Five."},
            ],
        },
        {"id": "d", "conversations": [{"from": "human", "value": "Past the limit."}, {"from": "gpt", "value": "x"}]},
    ]
    path = tmp_path / "sg.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        json.dump(corpus, fh)
    encode, vocab = warm.load_tokenizer(shared_data / "tokenizers" / "llama2-spm")
    found = sharegpt_conversations(path, encode, vocab, namespace="llama2-spm", limit=2)
    assert [c.id for c in found] == ["a", "c"]
    assert [s.kind for s in found[1].segments] == ["input", "input", "output", "input", "output"]
    assert found[1].segments[2].tokens.tolist() == encode(["Four."])[0]
    # Written as a trace file and read back, each assistant turn is a request after its context.
    write_traces(found, tmp_path / "t.jsonl.gz")
    again = read_traces(tmp_path / "t.jsonl.gz")
    assert [(c.id, c.namespace, c.category) for c in again] == [(c.id, c.namespace, c.category) for c in found]
    requests = list(requests_of(again, passes=1))
    assert len(requests) == 3
    prompt, output = requests[2]
    assert output.tolist() == encode(["Five."])[0]
    assert prompt.tolist() == [t for s in found[1].segments[:4] for t in s.tokens.tolist()]
    with pytest.raises(warm.CorpusError, match="JSON list"):
        path.write_bytes(gzip.compress(b'{"not": "a list"}'))
        sharegpt_conversations(path, encode, vocab, namespace="x", limit=1)


def test_the_report_survives_a_server_gone_before_the_end(tmp_path: Path) -> None:
    # The server stops while the decoders step: they go on with their local fallback, and the
    # report keeps what they measured; the servers' own count, which cannot be read at the
    # end, is reported as missing with the reason.
    rng = np.random.default_rng(2)
    text = rng.integers(0, 50, 40).tolist()
    write_traces([_conv(("input", text), ("output", text[:20] * 2))], tmp_path / "t.jsonl.gz")
    running = start_service(ServiceConfig())
    running.service.create_namespace("ns", 64)
    config = LoadConfig(
        targets=(running.target,), namespace="ns", traces=tmp_path / "t.jsonl.gz", decoders=1, batch=2,
        seconds=3.0, deadline_s=0.2, passes=0,
    )  # fmt: skip

    def stop_once_serving() -> None:
        eventually(lambda: running.service.drafts >= 20, timeout_s=60)
        stop_service(running)

    stopper = threading.Thread(target=stop_once_serving)
    stopper.start()
    try:
        out = run_load(config)
    finally:
        stopper.join()
    assert out["steps"] > 0 and out["sequence_drafts_per_s"] > 0 and out["fallback_share"] > 0
    assert out["server_drafts_per_s"] is None
    assert out["server_stats_error"].startswith("UNAVAILABLE")


def test_chain_decoders_drafting_ahead_get_chains_ahead(tmp_path: Path) -> None:
    # Decoders verifying chains, as engines do, with their outcomes drafted ahead: the service
    # drafts ahead at each chain's own stopping points, and some steps go on with what it drafted.
    rng = np.random.default_rng(2)
    text = rng.integers(0, 50, 30).tolist()
    write_traces([_conv(("input", text), ("output", [*text, *text[:10], 7, *text[10:]]))], tmp_path / "t.jsonl.gz")
    running = start_service(ServiceConfig())
    try:
        running.service.create_namespace("ns", 64)
        config = LoadConfig(
            targets=(running.target,), namespace="ns", traces=tmp_path / "t.jsonl.gz", decoders=1, batch=2,
            seconds=1.0, deadline_s=1.0, passes=0, params=DraftParams(chain=4), lookahead=2,
        )  # fmt: skip
        result = run_decoder(config, 0)
    finally:
        stop_service(running)
    assert result.fallbacks == 0 and result.failures == 0
    assert result.ahead_hits > 0 and result.tokens > result.sequence_steps  # more than a token a step


def test_timeline_puts_every_decoders_steps_on_the_runs_clock() -> None:
    # Each decoder times its steps from its own first step; decoders start seconds apart (a
    # spawned process imports its libraries first). The windows are the run's, as the watched
    # processes' samples are: a decoder that began 12 s into the run stepped in the second one.
    config = LoadConfig(
        targets=("x",), namespace="ns", traces=Path("t"), batch=1, seconds=20.0, timeline_s=10.0, watch_pids=(7,)
    )
    began = 1000.0
    early = DecoderResult(steps=2, latencies=[0.001, 0.001], started=[0.0, 1.0], first_at=began + 5.0, seconds=2.0)
    late = DecoderResult(steps=1, latencies=[0.004], started=[0.0], first_at=began + 12.0, seconds=1.0)
    samples = [(6.0, {7: (100.0, 1.0)}), (13.0, {7: (300.0, 2.0)})]
    rows = summarise(config, [early, late], samples, server_drafts=3, elapsed=14, began=began)["timeline"]
    assert [(row["from_s"], row["steps"], row["rss_mib_7"]) for row in rows] == [(0.0, 2, 100.0), (10.0, 1, 300.0)]

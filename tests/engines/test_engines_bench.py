"""The engine benchmark's driver: its lines from literal measurements, and the whole driver on
the real llama.cpp engine against a real ``draftcache serve`` (vLLM's runner: a slow test, in
the vLLM virtualenv)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from draftcache.v1 import draftcache_pb2 as pb

from benchmarks.engine_runs import Measurement, share_batch
from benchmarks.engine_workloads import AGENT_REPEAT, SPEC_BENCH, EnginePrompt, build, save
from benchmarks.engines_bench import main, parser, row, run_workload, vllm_bench
from tests.faults import Serve

REQUIRED = ("engine", "workload", "method", "tokens_per_s", "mean_accepted_tokens", "identical_to_greedy")


def agent(group: str, name: str) -> EnginePrompt:
    return EnginePrompt(AGENT_REPEAT, group, name, (1, 2, 3))


def test_a_line_splits_the_agent_passes_and_names_what_differs() -> None:
    prompts = [agent("pass1", "t1"), agent("pass1", "t2"), agent("pass2", "t1"), agent("pass2", "t2")]
    plain = [
        Measurement([7] * 10, 1.0),
        Measurement([8] * 10, 1.0),
        Measurement([7] * 10, 1.0),
        Measurement([8] * 10, 1.0),
    ]
    ours = [
        Measurement([7] * 10, 1.0, steps=5, drafted=20, accepted=5),  # 10 tokens in 5 draft steps: 1 + 5/5
        Measurement([8] * 9 + [9], 1.0, steps=3, drafted=9, accepted=0),  # differs from plain's
        Measurement([7] * 10, 0.25, steps=1, drafted=9, accepted=9),  # all 9 drafted accepted: 10 tokens in 1 step
        Measurement([8] * 10, 0.25, steps=1, drafted=9, accepted=9),
    ]
    line = row("engine", prompts, "ours", ours, plain)
    assert {k: line[k] for k in REQUIRED} == {
        "engine": "engine",
        "workload": AGENT_REPEAT,
        "method": "ours",
        "tokens_per_s": 40 / 2.5,
        "mean_accepted_tokens": round(1 + 23 / 10, 3),
        "identical_to_greedy": 0.75,
    }
    assert line["by_group"] == {
        "pass1": {"tokens_per_s": 10.0, "mean_accepted_tokens": round(1 + 5 / 8, 3), "identical_to_greedy": 0.5},
        "pass2": {"tokens_per_s": 40.0, "mean_accepted_tokens": 10.0, "identical_to_greedy": 1.0},
    }
    assert line["differing"] == ["pass1:t2"]
    assert line["acceptance_rate"] == round(23 / 47, 3) and line["drafts"] == 10
    # Without the engine's decode timing, a step is the whole request's time over its steps.
    assert line["engine_step_ms"] == round(1e3 * 2.5 / (40 - 23), 3)
    assert "measured" in line

    reference = row("engine", prompts, "plain", plain, None)
    assert reference["reference"] is True and reference["identical_to_greedy"] == 1.0
    assert reference["mean_accepted_tokens"] == 1.0 and "differing" not in reference


class Batching:
    """A runner that batches: it answers each prompt with its own ids, and keeps what it ran."""

    engine = "fake"
    methods = ("plain", "ours")

    def __init__(self) -> None:
        self.unavailable: dict[str, str] = {}
        self.calls: list[tuple[str, int]] = []  # (method, prompts run together)

    def run(self, method: str, ids: Sequence[int]) -> Measurement:
        return self.run_batch(method, [ids])[0]

    def run_batch(self, method: str, prompts: Sequence[Sequence[int]]) -> list[Measurement]:
        self.calls.append((method, len(prompts)))
        return share_batch([list(p) for p in prompts], 1.0, [0.9] * len(prompts), 2, 6, 3)

    def begin_workload(self) -> None: ...

    def workload_notes(self, method: str) -> dict[str, Any]:
        return {}

    def close(self) -> None: ...


def test_a_batch_runs_its_prompts_together_and_never_both_agent_passes() -> None:
    prompts = [agent("pass1", "t1"), agent("pass1", "t2"), agent("pass1", "t3"), agent("pass2", "t1")]
    runner = Batching()
    runs = run_workload(runner, prompts, batch=2)
    assert runner.calls == [("plain", 2), ("ours", 2), ("ours", 1), ("plain", 1), ("plain", 1), ("ours", 1)]
    assert [r.tokens for r in runs["ours"]] == [list(p.ids) for p in prompts]
    line = row("fake", prompts, "ours", runs["ours"], runs["plain"], batch=2)
    assert line["batch"] == 2 and line["identical_to_greedy"] == 1.0 and line["drafts"] == 2 * 3
    assert set(line["by_group"]) == {"pass1", "pass2"}  # the passes never share a batch
    assert line["engine_step_ms"] > 0 and "first_token_s" not in line and "decode_tokens_per_s" not in line
    spec = [EnginePrompt(SPEC_BENCH, g, "p", (1, 2)) for g in ("qa", "rag")]
    assert row("fake", spec, "ours", runs["ours"][:2], runs["plain"][:2], batch=2)["by_group"] == {}
    with pytest.raises(ValueError, match="one prompt at a time"):
        run_workload(OnlyOne(), prompts, batch=2)


class OnlyOne:
    engine, methods, unavailable = "one", ("plain",), {}

    def run(self, method: str, ids: Sequence[int]) -> Measurement:
        return Measurement(list(ids), 1.0)

    def begin_workload(self) -> None: ...

    def workload_notes(self, method: str) -> dict[str, Any]:
        return {}

    def close(self) -> None: ...


@pytest.fixture
def serve(tmp_path: Path) -> Serve:
    with Serve(tmp_path / "data") as running:
        yield running


def test_llama_cpp_lines_for_every_workload_and_method(shared_data: Path, serve: Serve, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    workloads = build(shared_data, per_group=1, agent_tasks=1, max_user_tokens=500)  # > n_batch (512) in all
    workloads[SPEC_BENCH] = workloads[SPEC_BENCH][:1]
    prompts = tmp_path / "prompts.json"
    save(workloads, prompts)
    out = tmp_path / "lines.jsonl"
    args = ["--engine", "llama.cpp", "--workloads", str(prompts), "--target", f"127.0.0.1:{serve.port}"]
    # A generous deadline: this checks the driver and what the service learns between passes,
    # not speed (a loaded machine misses 5 ms, and the client then drafts locally a while).
    main(
        [
            *args,
            "--max-new-tokens",
            "16",
            "--deadline-ms",
            "250",
            "--llama-topk",
            "8",
            "--variant",
            "service:near=false,token_cost=0.1",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
    )

    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["workload"], x["method"]) for x in lines] == [
        (w, m)
        for w in (SPEC_BENCH, AGENT_REPEAT)
        for m in ("plain", "prompt-lookup", "draftcache", "draftcache-service")
    ]
    for x in lines:
        assert x["engine"] == "llama.cpp" and set(REQUIRED) <= set(x)
        assert x["tokens_per_s"] > 0 and x["mean_accepted_tokens"] >= 1.0
        # Every engine with flash attention: a batched verification rounds as a one-token step
        # does, so every method's output is plain greedy's (without it, near ties part).
        assert x["flash_attn"] is True and x["identical_to_greedy"] == 1.0, x
        assert x["tokens"] > 0 and x["prompts"] == len(workloads[x["workload"]])
        assert x["decode_tokens_per_s"] > 0  # timed from each run's first token, the prompt left out
        # Each engine keeps its prompts' states: pass 2 of the agent workload starts from them.
        assert x["prompt_cache_mib"] == 1024
        assert (x["prompt_cache_hits"] > 0) == (x["workload"] == AGENT_REPEAT)
    ours = next(x for x in lines if x["workload"] == AGENT_REPEAT and x["method"] == "draftcache")
    # Drafting near (the default): every draft made in the engine's process. Pass 2 asks pass
    # 1's task again, which the near copy finished and drafts, more tokens per step.
    assert ours["remote_drafts"] == 0 and ours["topk"] == 8
    assert ours["by_group"]["pass2"]["mean_accepted_tokens"] > ours["by_group"]["pass1"]["mean_accepted_tokens"]
    # A variant is one more draft model with settings of its own, in a namespace of its own:
    # drafting through the service, which has pass 1's answer (committed at the end of the
    # generation) and drafts it, many tokens per step. Its chains are cut at a set token cost:
    # cut where the steps' measured cost puts the bar, a loaded machine (whose batched steps cost
    # more there) proposes few tokens, and pass 2 had 2.0 tokens a step.
    service = next(x for x in lines if x["workload"] == AGENT_REPEAT and x["method"] == "draftcache-service")
    assert service["near"] == "false"
    assert service["by_group"]["pass2"]["mean_accepted_tokens"] > 2.0
    assert service["by_group"]["pass2"]["mean_accepted_tokens"] > service["by_group"]["pass1"]["mean_accepted_tokens"]
    # Where its drafts came from, per workload: one per step, the service's or the local fallback's.
    assert service["remote_drafts"] > 0 and service["remote_drafts"] + service["fallback_drafts"] >= service["drafts"]
    assert service["draft_call_wait_ms"] > 0  # the mean wait on a draft call's reply
    assert service["topk"] == 8  # the engine's rows went back with its steps
    names = {n.name for n in serve.admin.Namespaces(pb.NamespacesRequest(), timeout=10).namespaces}
    assert {"smollm2", "smollm2-service"} <= names


def test_llama_cpp_drafts_beside_a_small_model_of_its_own(serve: Serve) -> None:
    # SmolLM2 beside itself in a Llama of its own (the only GGUF here), at a set token cost: the
    # model reads every step and its chains, the target's own greedy text, go where the cache's
    # are less likely, and are accepted; the output is plain greedy's (flash attention on).
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from benchmarks.engines_llamacpp import BESIDE
    from benchmarks.engines_llamacpp_runner import LlamaCppRunner

    runner = LlamaCppRunner(
        target=f"127.0.0.1:{serve.port}",
        namespace="smollm2",
        max_new_tokens=32,
        deadline_s=0.25,
        chain_min_prob=0.1,
        token_cost=0.1,
        methods=["draftcache"],
        draft_model="smollm2",
    )
    try:
        assert runner.methods == ("plain", "draftcache", BESIDE)
        llm = runner._engines.llms["plain"]
        text = b"<|im_start|>user\nList the planets of the solar system in order.<|im_end|>\n<|im_start|>assistant\n"
        ids = llm.tokenize(text, add_bos=False, special=True)
        plain = runner.run("plain", ids)
        runner.begin_workload()
        beside = runner.run(BESIDE, ids)
        notes, alone = runner.workload_notes(BESIDE), runner.workload_notes("draftcache")
    finally:
        runner.close()
    assert len(beside.tokens) == len(plain.tokens) > 16  # 32, or fewer where the answer ends
    assert beside.tokens == plain.tokens
    assert notes["model_steps"] > 0 and notes["model_accepted"] >= 0.8 * notes["model_proposed"] > 0, notes
    assert notes["model_skipped"] == notes["model_waited"] == 0  # a set cost prices no read
    assert notes["model_forwards"] > 0 and notes["model_tokens_read"] >= len(ids)
    assert beside.steps is not None and beside.steps < len(beside.tokens) / 2  # its chains went whole
    assert "model_steps" not in alone  # draftcache without a model has no model's part


def test_a_llama_cpp_draft_model_that_is_no_file_stops_the_run_before_any_engine_loads(
    serve: Serve, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from benchmarks.engines_llamacpp_runner import LlamaCppRunner

    with pytest.raises(RuntimeError, match="no GGUF file"):
        LlamaCppRunner(
            target=f"127.0.0.1:{serve.port}",
            namespace="smollm2",
            max_new_tokens=8,
            deadline_s=0.25,
            chain_min_prob=0.1,
            draft_model=str(tmp_path / "missing.gguf"),
        )


def test_a_variant_is_draftcache_with_its_own_settings_namespace_and_stats(tmp_path: Path) -> None:
    from benchmarks.engines_vllm import VllmBench, llm_kwargs, variant

    method, settings = variant("cut2:chain_min_prob=0.2")
    config = VllmBench(target="h:1", work_dir=tmp_path, namespace="m", variants={method: settings})
    ours = llm_kwargs("draftcache", config, tmp_path, tmp_path / "a.json")
    theirs = llm_kwargs(method, config, tmp_path, tmp_path / "b.json")
    assert ours["speculative_config"] == theirs["speculative_config"]
    mine, other = ours["additional_config"]["draftcache"], theirs["additional_config"]["draftcache"]
    assert (mine["namespace"], other["namespace"]) == ("m", "m-cut2")
    assert (mine["chain_min_prob"], other["chain_min_prob"]) == (0.1, "0.2")
    assert (mine["stats_path"], other["stats_path"]) == (str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert {k: v for k, v in mine.items() if k not in ("namespace", "chain_min_prob", "stats_path")} == {
        k: v for k, v in other.items() if k not in ("namespace", "chain_min_prob", "stats_path")
    }
    elsewhere = VllmBench(target="h:1", work_dir=tmp_path, variants={"draftcache-old": {"target": "h:2"}})
    targets = [llm_kwargs(m, elsewhere, tmp_path, tmp_path / "s.json")["additional_config"]["draftcache"]["target"]
               for m in ("draftcache", "draftcache-old")]  # fmt: skip
    assert targets == ["h:1", "h:2"]  # a variant may draft from another service
    with pytest.raises(ValueError, match="draftcache-NAME"):
        VllmBench(target="h:1", work_dir=tmp_path, variants={"suffix": {}})


def test_a_draft_model_runs_vllms_own_method_and_draftcache_beside_it(tmp_path: Path) -> None:
    from benchmarks.engines_vllm import BESIDE, DRAFT_MODEL, llm_kwargs

    a = parser().parse_args(["--engine", "vllm", "--workloads", "w.json", "--draft-model", str(tmp_path), "--k", "6"])
    a.variants = {}
    config = vllm_bench(a)
    assert config.methods() == ["plain", "ngram", "suffix", "draftcache", DRAFT_MODEL, BESIDE]
    theirs = llm_kwargs(DRAFT_MODEL, config, tmp_path, tmp_path / "s.json")
    assert theirs["speculative_config"] == {
        "method": "draft_model",
        "model": str(tmp_path),
        "num_speculative_tokens": 6,
    }
    assert "additional_config" not in theirs
    ours = llm_kwargs(BESIDE, config, tmp_path, tmp_path / "b.json")["additional_config"]["draftcache"]
    assert (ours["draft_model"], ours["namespace"]) == (str(tmp_path), "smollm2-beside")
    plain_ours = llm_kwargs("draftcache", config, tmp_path, tmp_path / "a.json")["additional_config"]["draftcache"]
    assert "draft_model" not in plain_ours  # draftcache alone stays alone
    a.variants = {BESIDE: {}}
    with pytest.raises(ValueError, match="the draft model's variant"):
        vllm_bench(a)


def test_the_kv_cache_flag_reaches_every_engine(tmp_path: Path) -> None:
    from benchmarks.engines_vllm import VllmBench, llm_kwargs

    def kv_bytes(*flags: str) -> set[int]:
        a = parser().parse_args(["--engine", "vllm", "--workloads", "w.json", *flags])
        a.variants = {"draftcache-b": {"chain_min_prob": "0.2"}}
        config = vllm_bench(a)
        return {
            llm_kwargs(m, config, tmp_path, tmp_path / "s.json")["kv_cache_memory_bytes"]
            for m in ("plain", "suffix", "draftcache", "draftcache-b")
        }

    assert kv_bytes("--kv-cache-mib", "640") == {640 << 20}
    assert kv_bytes() == {VllmBench.kv_cache_mib << 20}


def test_every_vllm_engine_runs_in_float32_unless_told(tmp_path: Path) -> None:
    """float32 by default: there every drafting method's output can be plain greedy's, so the
    run checks it and the methods' rates compare equal work (bfloat16 rounds a batched
    verification unlike a one-token step)."""
    from benchmarks.engines_vllm import cpu_dtype, llm_kwargs

    def dtypes(*flags: str) -> set[str]:
        a = parser().parse_args(["--engine", "vllm", "--workloads", "w.json", *flags])
        a.variants = {"draftcache-b": {}}
        config = vllm_bench(a)
        return {llm_kwargs(m, config, tmp_path, tmp_path / "s.json")["dtype"] for m in ("plain", "draftcache-b")}

    assert dtypes() == {"float32"}
    assert dtypes("--dtype", "bfloat16") == {"bfloat16"}
    assert dtypes("--dtype", "auto") == {cpu_dtype()}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "llama.cpp", "--variant", "a:chain_min_prob=2"], "chain_min_prob must be in"),
        (["--engine", "vllm", "--variant", "a:chain_min_prob=2"], "chain_min_prob must be in"),
        (["--engine", "vllm", "--variant", "a:no_such=1"], "unknown draftcache settings"),
        (["--engine", "vllm", "--variant", "a:stats_path=x"], "stats_path is set by the benchmark"),
        (["--engine", "vllm", "--variant", "a:x", "--variant", "a:y"], "not key=value"),
        (["--engine", "vllm", "--variant", "a:", "--variant", "a:deadline_s=0.01"], "two variants with one name"),
        (["--engine", "vllm", "--variant", "a b:"], "NAME of letters"),
        (["--engine", "vllm", "--kv-cache-mib", "0"], "--kv-cache-mib must be >= 1"),
        (["--engine", "vllm", "--dtype", "fp8"], "invalid choice: 'fp8'"),
        (["--engine", "llama.cpp", "--llama-topk", "9"], "--llama-topk must be in [0, 8]"),
        (["--engine", "llama.cpp", "--batch", "2"], "above 1 only for vllm"),
        (["--engine", "vllm", "--batch", "0"], "--batch must be >= 1"),
    ],
)
def test_bad_variants_are_refused_before_any_engine_starts(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workloads = tmp_path / "w.json"
    workloads.write_text("{}")
    with pytest.raises(SystemExit):
        main([*args, "--workloads", str(workloads), "--work-dir", str(tmp_path)])
    assert message in capsys.readouterr().err

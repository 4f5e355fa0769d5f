"""The llama.cpp proposer replayed offline over recorded outputs (benchmarks/proposer_replay.py):
the real proposer and near copy, steps timed by the cost line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.proposer_replay import (
    CostLine,
    Recorded,
    load_outputs,
    main,
    proposer,
    replay,
    save_outputs,
    select,
)

VOCAB = 49152


def requests(n: int = 4, seed: int = 0) -> list[Recorded]:
    """Answers that copy stretches of their prompts, a token changed here and there: the
    proposer drafts some of each, and its chains run to different lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(100, 160, size=300).astype(np.int32)
        answer = prompt[40:190].copy()
        changed = rng.choice(answer.size, size=12, replace=False)
        answer[changed] = rng.integers(200, 260, size=changed.size)
        out.append(Recorded("spec_bench", f"g{i % 2}", prompt, answer))
    return out


def totals(tallies: dict) -> dict[str, float]:
    keys = ("requests", "tokens", "steps", "proposed", "accepted", "plain_ms", "drafted_ms")
    return {k: sum(getattr(t, k) for t in tallies.values()) for k in keys}


def run(cost: CostLine, recorded: list[Recorded], **settings: object) -> tuple[dict[str, float], object]:
    model, clock = proposer(dict(settings), "", 8, VOCAB)
    try:
        tallies = replay(model, clock, cost, recorded)
    finally:
        model.close()
    return totals(tallies), model


def test_each_step_is_timed_by_the_cost_line_and_the_tokens_add_up() -> None:
    recorded = requests()
    t, _ = run(CostLine(10.0, 3.0, 2.0), recorded, chain_min_prob=0.0, token_cost=0.0)
    assert t["requests"] == len(recorded) and t["tokens"] == sum(r.output.size for r in recorded)
    assert 0 < t["accepted"] <= t["proposed"]  # the answers copy their prompts
    # Each step takes the accepted tokens and the next (none past the output's end); the first
    # token came from the prompt's step.
    made = t["requests"] + t["steps"] + t["accepted"]
    assert made - t["requests"] <= t["tokens"] <= made
    assert t["plain_ms"] == pytest.approx(10.0 * t["tokens"])
    drafting_steps = t["drafted_ms"] - 10.0 * (t["steps"] + t["requests"]) - 2.0 * t["proposed"]
    assert drafting_steps == pytest.approx(3.0 * round(drafting_steps / 3.0))  # 3 ms per step that drafted
    assert 0 < drafting_steps / 3.0 <= t["steps"]


def test_the_proposer_measures_the_replayed_steps() -> None:
    # The engine's cost line, measured by the proposer from the replay clock's steps, is the
    # line the replay timed them by (the host's own time between calls would be ~1 ms).
    _, model = run(CostLine(20.0, 0.0, 5.0), requests(8, seed=1))
    summary = model.cost.summary()
    assert summary["cost_measured"]
    assert summary["step_base_ms"] == pytest.approx(20.0, abs=0.5)
    assert summary["step_per_token_ms"] == pytest.approx(5.0, abs=0.25)


def test_a_replay_proposes_the_same_chains_every_run() -> None:
    a, _ = run(CostLine(15.0, 1.0, 5.0), requests())
    b, _ = run(CostLine(15.0, 1.0, 5.0), requests())
    assert a == b


def test_a_dearer_token_cuts_chains_shorter() -> None:
    cheap, _ = run(CostLine(15.0, 0.0, 0.5), requests(6), token_cost=-1.0)
    dear, _ = run(CostLine(15.0, 0.0, 12.0), requests(6), token_cost=-1.0)
    assert dear["proposed"] < cheap["proposed"]


def test_outputs_round_trip_and_bad_rows_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "outputs.json"
    save_outputs(requests(2), path)
    back = load_outputs(path)
    assert [r.group for r in back] == ["g0", "g1"]
    assert all(np.array_equal(x.output, y.output) for x, y in zip(back, requests(2), strict=True))
    good = {"workload": "spec_bench", "group": "qa", "prompt": [1, 2], "output": [3]}
    for bad, why in (
        ({**good, "prompt": []}, "non-empty prompt"),
        ({**good, "output": [1.5]}, "integer ids"),
        ({**good, "output": [VOCAB]}, f"in [0, {VOCAB})"),
        ({**good, "prompt": [-1, 2]}, f"in [0, {VOCAB})"),
        ({k: v for k, v in good.items() if k != "output"}, "not a recorded request"),
    ):
        path.write_text(json.dumps([good, bad]))
        with pytest.raises(ValueError, match="row 1") as err:
            load_outputs(path)
        assert why in str(err.value)


def test_select_takes_the_quick_benchmarks_share() -> None:
    agent = [Recorded("agent_repeat", p, np.array([1]), np.arange(10, dtype=np.int32)) for p in ("pass1",) * 3]
    chosen = select(requests(4) + agent, per_group=1, tasks=2, max_new=5)
    assert [(r.workload, r.group) for r in chosen] == [
        ("spec_bench", "g0"), ("spec_bench", "g1"), ("agent_repeat", "pass1"), ("agent_repeat", "pass1"),
    ]  # fmt: skip
    assert all(r.output.size <= 5 for r in chosen)


@pytest.mark.parametrize("cost", ["15,1", "0,1,1", "15,1,x", "15,nan,1"])
def test_a_cost_line_out_of_range_is_refused(cost: str) -> None:
    with pytest.raises(ValueError, match="BASE,PER_STEP,PER_TOKEN"):
        CostLine.parse(cost)


def test_the_command_prints_a_line_per_group_and_one_for_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "outputs.json"
    save_outputs(requests(4), path)
    main(["replay", "--outputs", str(path), "--cost", "15.2,1.7,5.45", "--set", "chain_min_prob=0.1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["group"] for line in lines] == ["g0", "g1", "all"]
    assert lines[-1]["requests"] == 4 and lines[-1]["speedup"] > 0
    with pytest.raises(SystemExit):
        main(["replay", "--outputs", str(path), "--cost", "15,1,1", "--set", "chain_min_prob"])

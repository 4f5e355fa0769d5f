"""``draftcache replay`` on a trace that records the target's top-k: on by default, off with
``--no-topk``, refused where the trace has none or an id lies outside the vocabulary."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from cache_service.cli import main

OUTPUT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _conv(cid: str, prompt: list[int], *, topk: bool = True) -> dict:
    output: dict = {"kind": "output", "tokens": OUTPUT}
    if topk:
        output["topk"] = [[t, 40 + i, 60 + i] for i, t in enumerate(OUTPUT)]
    return {"id": cid, "namespace": "toy", "segments": [{"kind": "input", "tokens": prompt}, output]}


def _write(path: Path, *, topk: bool = True) -> Path:
    with gzip.open(path, "wt") as fh:
        for conv in (_conv("a", OUTPUT, topk=topk), _conv("b", [20, 21], topk=topk)):
            fh.write(json.dumps(conv) + "\n")
    return path


def _replay(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["replay", *args, "--baselines", "prompt-lookup", "--json"]) == 0
    return {r["drafter"]: r for r in json.loads(capsys.readouterr().out)["results"]}


def test_topk_handed_over_by_default_not_with_no_topk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _write(tmp_path / "t.jsonl.gz")
    on = _replay(capsys, str(traces))
    # Every output position is verified exactly once: 18 rows for 18 output tokens, each drafter.
    assert [(r["topk_rows"], r["output_tokens"]) for r in on.values()] == [(18, 18), (18, 18)]
    off = _replay(capsys, str(traces), "--no-topk")
    assert all("topk_rows" not in r for r in off.values())
    # Prompt lookup has no use for the rows: the same MAT either way; every token replayed both ways.
    pld = next(d for d in on if d.startswith("prompt-lookup"))
    assert on[pld]["mat"] == off[pld]["mat"]
    assert {d: r["output_tokens"] for d, r in on.items()} == {d: r["output_tokens"] for d, r in off.items()}


def test_topk_refused_without_it_or_outside_the_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = _write(tmp_path / "plain.jsonl.gz", topk=False)
    # Asked for, on a trace that records none: a clear error, exit status 2.
    assert main(["replay", str(plain), "--topk"]) == 2
    assert "records no top-k" in capsys.readouterr().err
    # Without the flag, a plain trace replays as before.
    assert all("topk_rows" not in r for r in _replay(capsys, str(plain)).values())
    traces = _write(tmp_path / "t.jsonl.gz")
    # Tokens fit in 30 ids, the top-k names id 68.
    assert main(["replay", str(traces), "--vocab-size", "30"]) == 2
    assert "id 68 is outside the vocabulary [0, 30)" in capsys.readouterr().err

"""``draftcache replay --chain K --draft-rows F``: a draft model's chains and ours beside them,
in the same run as ours alone; refused without chains, through a service, or with rows made
from another trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.draft_rows import SegmentRows, fingerprint, write_rows
from benchmarks.traces import read_traces
from cache_service.cli import main

OUTPUT = [5, 6, 7, 8, 9, 10, 11, 12]


def _trace(path: Path) -> Path:
    with gzip.open(path, "wt") as fh:
        for cid, prompt in (("a", [1, 2, 3]), ("b", [20, 21])):
            conv = {
                "id": cid,
                "namespace": "toy",
                "segments": [{"kind": "input", "tokens": prompt}, {"kind": "output", "tokens": OUTPUT}],
            }
            fh.write(json.dumps(conv) + "\n")
    return path


def _rows(traces: Path, out: Path, *, right: bool = True, prob: float = 1.0) -> Path:
    """Rows of a model that guesses the trace's next token everywhere (or misses at position 1),
    each guess ``prob`` likely."""
    rows = {}
    for conv in read_traces(traces):
        ids = np.array(OUTPUT, np.int32) if right else np.array([5, 0, 7, 8, 9, 10, 11, 12], np.int32)
        rows[fingerprint(conv)] = [SegmentRows(ids[:, None], np.full((8, 1), np.log(prob), np.float32))]
    write_rows(out, rows, {"model": "toy", "vocab_size": 64})
    return out


def _replay(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["replay", *args, "--json"]) == 0
    return {r["drafter"]: r for r in json.loads(capsys.readouterr().out)["results"]}


def test_model_chains_and_ours_beside_them_in_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _trace(tmp_path / "t.jsonl.gz")
    got = _replay(capsys, str(traces), "--chain", "4", "--draft-rows", str(_rows(traces, tmp_path / "r.npz")))
    assert list(got)[-2:] == ["draft-model/greedy(4)", "draftcache+draft-model"]
    # Right everywhere and sure of it, 4 a chain: 5 tokens a step, then 3, whoever else drafts.
    assert got["draft-model/greedy(4)"]["mat"] == 4.0
    assert got["draftcache+draft-model"]["mat"] == 4.0
    unsure = _rows(traces, tmp_path / "m.npz", right=False, prob=1e-6)
    missing = _replay(capsys, str(traces), "--chain", "4", "--draft-rows", str(unsure))
    assert missing["draft-model/greedy(4)"]["mat"] == round(8 / 3, 4)  # 5 + bonus, 7 8 9 10 + bonus, 12
    # Sure of nothing, the model's chains are taken only where ours proposes nothing (here, each
    # request's first steps, before its text repeats): better than ours alone.
    assert missing["draftcache"]["mat"] < missing["draftcache+draft-model"]["mat"]


def test_draft_rows_refused_where_they_cannot_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _trace(tmp_path / "t.jsonl.gz")
    rows = _rows(traces, tmp_path / "r.npz")
    assert main(["replay", str(traces), "--draft-rows", str(rows)]) == 2
    assert "--draft-rows and --draft-model replay chains in-process" in capsys.readouterr().err
    assert main(["replay", str(traces), "--chain", "4", "--draft-rows", str(rows), "--target", "127.0.0.1:1"]) == 2
    assert "--draft-rows" in capsys.readouterr().err
    other = tmp_path / "other.jsonl.gz"
    with gzip.open(other, "wt") as fh:
        fh.write(json.dumps({"id": "a", "namespace": "toy", "segments": [{"kind": "output", "tokens": [1, 2]}]}) + "\n")
    assert main(["replay", str(other), "--chain", "4", "--draft-rows", str(rows)]) == 2
    assert "no rows for conversation 'a'" in capsys.readouterr().err


def test_make_draft_rows_checks_its_passes_and_trace_before_loading_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = _trace(tmp_path / "t.jsonl.gz")
    out = tmp_path / "rows.npz"
    assert main(["make-draft-rows", str(traces), "--out", str(out), "--window", "8", "--context", "8"]) == 2
    assert "context must be in [0, window)" in capsys.readouterr().err
    assert main(["make-draft-rows", str(tmp_path / "absent.jsonl.gz"), "--out", str(out)]) == 2
    assert "absent.jsonl.gz" in capsys.readouterr().err
    assert not out.exists()

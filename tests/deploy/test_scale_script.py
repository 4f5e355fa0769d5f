"""deploy/scale.sh end to end on its shortest setting: a small corpus, 1 then 2 processes, both
layouts (one ``serve --processes 2``, two independent ``serve`` processes on one Redis), run
from another directory with relative paths, as an operator starts it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from deploy_files import run_script


@pytest.mark.slow  # five server starts and four 3 s loads (60-120 s on two cores)
def test_scale_script_measures_every_layout(shared_data: Path, tmp_path: Path) -> None:
    caller = tmp_path / "a caller's dir"
    caller.mkdir()
    texts = [f"Step {i}: open the file, read line {i % 7}, then write the answer back." for i in range(300)]
    conversations = [{"conversations": [{"from": "human", "value": "go"}, {"from": "gpt", "value": t}]} for t in texts]
    with gzip.open(caller / "corpus.json.gz", "wt") as f:
        json.dump(conversations, f)
    shared = str(shared_data.parent)
    done = run_script("scale.sh", ["2", "3", "corpus.json.gz"], caller, 600, OUT="scale-run", DRAFTCACHE_SHARED=shared)
    out = caller / "scale-run"
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    layouts = [(r["layout"], r["processes"]) for r in lines if "layout" in r]
    assert layouts == [("one", 1), ("shared", 2), ("independent", 2)]
    loads = [r for r in lines if "load" in r]
    assert [r["load"] for r in loads] == ["one-1", "shared-2", "independent-2"]
    assert all(r["sequence_drafts_per_s"] > 0 for r in loads)
    # The two independent processes journal apart: each its own data directory.
    assert (out / "independent-2-1" / "journal").is_dir() and (out / "independent-2-2" / "journal").is_dir()

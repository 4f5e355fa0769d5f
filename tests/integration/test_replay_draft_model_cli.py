"""``draftcache replay --chain K --draft-model M``: a draft model run at every step, alone and
beside ours, in the same run; refused without chains, a draft tokenizer without the traces' own,
and a cut off the trace without a GGUF model to cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cache_service.cli import main
from tests.integration.test_replay_draft_rows_cli import _trace


def _model(folder: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_live_draft_model_alone_and_beside_ours(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _trace(tmp_path / "t.jsonl.gz")
    args = [str(traces), "--chain", "4", "--vocab-size", "64", "--draft-model", str(_model(tmp_path / "m")), "--json"]
    assert main(["replay", *args]) == 0
    got = {r["drafter"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert list(got)[-2:] == ["draft-model/live(4)", "draftcache+draft-model/live"]
    ours, alone, beside = got["draftcache"], got["draft-model/live(4)"], got["draftcache+draft-model/live"]
    # A random model is right by chance at best: the mix keeps ours wherever ours is likelier.
    assert alone["mat"] < ours["mat"] and beside["mat"] >= alone["mat"]
    assert alone["steps"] > 0 and beside["steps"] > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft-model", "smollm2"], "give --chain K and no --target"),
        (["--chain", "4", "--draft-model", "smollm2", "--draft-tokenizer", "x"], "give both"),
        (["--chain", "4", "--draft-tokenizer", "x", "--tokenizer", "y"], "give both"),
        (["--chain", "4", "--cut-off-trace"], "cuts a --draft-model's chains: give one"),
        (["--chain", "4", "--draft-model", "a/folder", "--cut-off-trace"], "a GGUF --draft-model"),
    ],
)
def test_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    traces = _trace(tmp_path / "t.jsonl.gz")
    assert main(["replay", str(traces), *extra]) == 2
    assert message in capsys.readouterr().err

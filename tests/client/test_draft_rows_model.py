"""make-draft-rows with real models: one teacher-forced pass gives, at every output position,
what the model predicts from the text before it (window by window), and a greedy chain read off
the rows is what the model's own greedy decoding proposes there, up to the trace's first
disagreement with it."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.draft_rows import DraftRows, fingerprint, make_rows, predict_stream, windows
from benchmarks.traces import Conversation, read_traces
from tests.client.conftest import greedy_continuation


def _next_logp(model, tokens: np.ndarray) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The model's log-probs for the token after ``tokens``, read alone."""
    with torch.inference_mode():
        logits = model(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("window,context", [(64, 0), (16, 5), (9, 8)])
def test_every_row_is_the_models_prediction_from_its_window(
    tiny_llama: Callable[..., torch.nn.Module], window: int, context: int
) -> None:
    model = tiny_llama()
    tokens = np.random.default_rng(0).integers(0, 128, 40).astype(np.int32)
    ids, logp = predict_stream(model, tokens, k=3, window=window, context=context)
    assert ids[0].tolist() == [-1, -1, -1] and np.isneginf(logp[0]).all()
    for start, end, first in windows(tokens.size, window, context):
        for p in range(first + 1, min(end, tokens.size - 1) + 1):
            expected = _next_logp(model, tokens[start:p])  # the window's text before position p
            top = torch.topk(expected, 3)
            assert ids[p].tolist() == top.indices.tolist(), p
            np.testing.assert_allclose(logp[p], top.values.numpy(), atol=1e-4)


def test_rows_chains_are_smollm2s_greedy_chains_on_an_agent_trace(shared_data: Path, smollm2) -> None:  # type: ignore[no-untyped-def]
    model, _ = smollm2
    trace = shared_data / "traces/swe_agent_dev.jsonl.gz"
    if not trace.is_file():
        pytest.skip(f"{trace} not found")
    conv = read_traces(trace, limit=1)[0]
    # The first request: the system prompt and task, then the agent's first answer.
    prompt, answer = conv.segments[0], conv.segments[1]
    assert prompt.kind == "input" and answer.kind == "output" and answer.tokens.size >= 36
    first = Conversation(conv.id, conv.namespace, conv.category, (prompt, answer))
    (rows,) = make_rows(model, [first], k=2, window=4096, context=1024)[fingerprint(first)]
    context, truth = prompt.tokens, answer.tokens
    right = 0
    for pos in range(0, 31, 10):
        greedy = greedy_continuation(model, np.concatenate((context, truth[:pos])).tolist(), 6)
        agree = next((j for j in range(6) if greedy[j] != truth[pos + j]), 6)
        # Up to the first token the trace disagrees with (that one included), the chain read off
        # the rows is what the model's own decoding proposes.
        assert rows.chain(pos, 6).tolist()[: agree + 1] == greedy[: agree + 1], pos
        right += agree
    assert right > 0  # the model does predict some of the agent's text


def test_make_draft_rows_command_writes_rows_replay_reads(
    shared_data: Path, smollm2, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    from cache_service.cli import main

    trace = shared_data / "traces/swe_agent_dev.jsonl.gz"
    if not trace.is_file():
        pytest.skip(f"{trace} not found")
    conv = read_traces(trace, limit=1)[0]
    prompt, answer = conv.segments[0].tokens[-200:], conv.segments[1].tokens
    small = tmp_path / "t.jsonl.gz"
    line = {
        "id": "one",
        "namespace": "smollm2",
        "segments": [{"kind": "input", "tokens": prompt.tolist()}, {"kind": "output", "tokens": answer.tolist()}],
    }
    with gzip.open(small, "wt") as fh:
        fh.write(json.dumps(line) + "\n")
    out = tmp_path / "rows.npz"
    options = ["--window", "128", "--context", "32", "--dtype", "float32"]
    options += ["--tokenizer", str(shared_data / "tokenizers/smollm2")]
    assert main(["make-draft-rows", str(small), "--out", str(out), *options]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["output_tokens"] == answer.size and 0 < summary["top1_right"] <= 1
    (rows,) = DraftRows(out).requests(read_traces(small))
    assert rows.ids.shape == (answer.size, 4) and (rows.ids[:, 0] == answer).mean() == pytest.approx(
        summary["top1_right"], abs=1e-4
    )
    # An id the model cannot read is refused before any pass, and nothing is written.
    line["segments"][1]["tokens"] = [*answer.tolist()[:5], 60_000]
    with gzip.open(small, "wt") as fh:
        fh.write(json.dumps(line) + "\n")
    assert main(["make-draft-rows", str(small), "--out", str(tmp_path / "none.npz"), *options]) == 2
    assert "60000" in capsys.readouterr().err and not (tmp_path / "none.npz").exists()

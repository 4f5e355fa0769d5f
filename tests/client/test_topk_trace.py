"""make-topk-trace with the real SmolLM2 on real Spec-Bench questions: greedy answers equal to a
plain ``model.generate``, each with the target's top-8 at every output position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from benchmarks.topk_trace import (
    NAMESPACE,
    TopkTraceConfig,
    make_trace,
    spec_bench_questions,
    stats,
    write_atomic,
)
from benchmarks.traces import read_traces

NEW_TOKENS = 16


def _generate(model, context: np.ndarray, eos: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Plain greedy ``model.generate`` of one unpadded prompt, cut after its first EOS."""
    x = torch.tensor([context.tolist()])
    with torch.inference_mode():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=eos
        )
    new = out[0, x.shape[1] :].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def test_trace_of_three_questions_matches_plain_greedy(shared_data: Path, smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    found = spec_bench_questions(
        shared_data / "traces/spec_bench_vicuna7b.jsonl.gz", shared_data / "tokenizers/llama2-spm", 1
    )
    # One question per Spec-Bench task group, each with its own category; MT-bench's has 2 turns.
    assert len(found) == 6 and found[0].category == "writing" and len(found[0].turns) == 2
    questions = [q for q in found if q.category in ("writing", "translation", "math_reasoning")]
    config = TopkTraceConfig(per_group=1, turns=2, max_new_tokens=NEW_TOKENS, batch=3)
    conversations = make_trace(model, tokenizer, questions, config)
    eos = int(tokenizer.eos_token_id)
    for conv, question in zip(conversations, questions, strict=True):
        assert (conv.id, conv.category, conv.namespace) == (question.id, question.category, NAMESPACE)
        context = np.zeros(0, dtype=np.int32)
        for seg in conv.segments:
            if seg.kind == "output":
                # Batched with the others, left-padded: the same tokens as greedy alone.
                assert seg.tokens.tolist() == _generate(model, context, eos), conv.id
                # One row of 8 distinct ids per token, the greedy token first.
                assert seg.topk is not None and seg.topk.shape == (seg.tokens.size, 8)
                assert (seg.topk[:, 0] == seg.tokens).all()
                assert all(len(set(row)) == 8 for row in seg.topk.tolist())
            context = np.concatenate((context, seg.tokens))
    writing = conversations[0]
    # The MT-bench question was asked twice; its second prompt is the chat template of both
    # turns with the model's own first answer (cut at 16 tokens, so no EOS of its own).
    assert [s.kind for s in writing.segments] == ["input", "output", "input", "output"]
    answer = tokenizer.decode(writing.segments[1].tokens)
    messages = [
        {"role": "user", "content": questions[0].turns[0]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": questions[0].turns[1]},
    ]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(np.concatenate([s.tokens for s in writing.segments[:3]])) == expected
    # The file reads back whole, top-k included.
    path = tmp_path / "t.jsonl.gz"
    write_atomic(conversations, path)
    back = read_traces(path)
    assert [c.id for c in back] == [c.id for c in conversations] and all(c.has_topk for c in back)
    assert back[0].segments[3].topk.tolist() == writing.segments[3].topk.tolist()  # type: ignore[union-attr]
    summary = stats(back)
    assert summary["answers"] == 4 and summary["by_category"]["writing"]["answers"] == 2
    assert summary["output_tokens"] == sum(c.output_tokens for c in conversations)

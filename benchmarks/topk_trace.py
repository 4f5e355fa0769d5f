"""``draftcache make-topk-trace``: a trace of SmolLM2 greedy answers to the Spec-Bench questions
with the target's top-k next tokens at every output position.

A decoder sees the target's logits wherever it verifies; replaying this trace can hand the
drafter exactly the top-k lists a decoder would have seen (``replay --topk``). Each output
segment carries ``topk``: row ``i`` lists the ``k`` most likely next tokens, most likely first,
at the position that predicted output token ``i``, so ``topk[i][0] == tokens[i]`` (greedy).

Questions: the first turn of each Spec-Bench conversation (Llama-2 ids decoded to text, the
Vicuna template stripped), the same number from each of Spec-Bench's six task groups (MT-bench's
eight categories spread evenly inside its group), each kept with its own category. With
``turns=2`` the MT-bench questions get their second turn too, asked after the model's own first
answer. Every question goes through SmolLM2's chat template; answers are greedy, at most
``max_new_tokens`` tokens, ending with the EOS token when the model stops.

The committed ``benchmarks/data/spec_bench_smollm2_topk.jsonl.gz`` was made with::

    draftcache make-topk-trace --per-group 40 --turns 1 --max-new-tokens 256 --batch 8 \\
        --threads 2 --out benchmarks/data/spec_bench_smollm2_topk.jsonl.gz

240 answers (40 per task group, 5 per MT-bench category), 40,211 output tokens, 130 of them
ended by EOS and 110 cut at 256 tokens; 2 h 13 min on two CPU cores shared with other work.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.generate_bench import MT_BENCH, vicuna_question
from benchmarks.traces import MAX_TOPK, Conversation, Segment, spread, write_traces

logger = logging.getLogger(__name__)

NAMESPACE = "smollm2"


@dataclass(frozen=True, kw_only=True)
class TopkTraceConfig:
    """What to generate: questions per task group, turns, answer length, top-k width, batching."""

    per_group: int = 40
    turns: int = 1  # 2: MT-bench's second turns too
    max_new_tokens: int = 256
    k: int = MAX_TOPK
    batch: int = 8  # prompts decoded together (similar lengths, so little padding)

    def __post_init__(self) -> None:
        for name in ("per_group", "max_new_tokens", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.turns not in (1, 2):
            raise ValueError(f"turns must be 1 or 2, got {self.turns}")
        if not 1 <= self.k <= MAX_TOPK:
            raise ValueError(f"k must be in [1, {MAX_TOPK}], got {self.k}")


@dataclass(frozen=True)
class Question:
    """One Spec-Bench conversation's user turns, as plain text, with its category."""

    id: str
    category: str
    turns: tuple[str, ...]


def spec_bench_questions(traces: Path, llama_tokenizer: Path, per_group: int) -> list[Question]:
    """``per_group`` conversations of each Spec-Bench task group, spread evenly over the group
    (in file order, so MT-bench's categories share its quota), with every user turn they hold.

    Spec-Bench's ids are Llama-2's: decoded with that tokenizer, then stripped of the Vicuna
    template (``USER: ... ASSISTANT:``)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(llama_tokenizer / "tokenizer.model"))
    groups: dict[str, list[dict[str, Any]]] = {}
    for conv in _lines(traces):
        groups.setdefault("mt_bench" if conv["category"] in MT_BENCH else conv["category"], []).append(conv)
    out = []
    for convs in groups.values():
        for conv in spread(convs, per_group):
            inputs = [s["tokens"] for s in conv["segments"] if s["kind"] == "input"]
            turns = tuple(vicuna_question(sp.decode(ids)) for ids in inputs)
            out.append(Question(str(conv["id"]), str(conv["category"]), turns))
    return out


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


class _TopkRecorder:
    """A logits processor that leaves the scores as they are and keeps each step's top-k."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.ids: list[torch.Tensor] = []  # per step: (batch, k)
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top = torch.topk(scores, self.k, dim=-1)
        self.ids.append(top.indices)
        self.values.append(top.values)
        return scores


def greedy_with_topk(
    model: Any, prompts: list[list[int]], max_new_tokens: int, eos: int, k: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Greedy answers to ``prompts`` decoded as one left-padded batch with the KV cache, each cut
    after its first ``eos``: ``(tokens, topk)`` per prompt, ``topk`` of shape ``(len(tokens), k)``
    with ``topk[i, 0] == tokens[i]``."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    recorder = _TopkRecorder(k)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
            logits_processor=LogitsProcessorList([recorder]),
        )
    new = out[:, width:].numpy()
    top_ids = torch.stack(recorder.ids, dim=1).numpy()
    top_values = torch.stack(recorder.values, dim=1).numpy()
    return [_answer(new[row], top_ids[row], top_values[row], eos) for row in range(len(prompts))]


def _answer(new: np.ndarray, top_ids: np.ndarray, top_values: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """One row of a batch: its tokens up to and with the first EOS, and their top-k rows with the
    chosen token first (greedy picks the first of tied maxima, top-k may order ties otherwise)."""
    stops = np.flatnonzero(new == eos)
    n = int(stops[0]) + 1 if stops.size else new.size
    tokens = new[:n].astype(np.int32)
    rows = top_ids[:n].astype(np.int32)
    for i in np.flatnonzero(rows[:, 0] != tokens):
        where = np.flatnonzero(rows[i] == tokens[i])
        if not where.size or top_values[i, where[0]] != top_values[i, 0]:
            raise RuntimeError(f"greedy token {tokens[i]} at {i} is not the top-1 of the logits seen")
        rows[i, [0, where[0]]] = rows[i, [where[0], 0]]
    return tokens, rows


@dataclass
class _Pending:
    """A question in progress: its conversation so far and where its next prompt ends."""

    question: Question
    segments: list[Segment]

    def prompt(self) -> list[int]:
        return [int(t) for s in self.segments for t in s.tokens]


def make_trace(model: Any, tokenizer: Any, questions: list[Question], config: TopkTraceConfig) -> list[Conversation]:
    """Every question answered (turn by turn), as conversations in the questions' order."""
    eos = int(tokenizer.eos_token_id)
    pending = [_Pending(q, [Segment("input", _encode(tokenizer, q.turns[:1], []))]) for q in questions]
    for turn in range(config.turns):
        active = [p for p in pending if turn < len(p.question.turns)]
        if turn:
            for p in active:
                p.segments.append(Segment("input", _next_turn(tokenizer, p, eos)))
        _answer_all(model, active, config, eos)
    return [Conversation(p.question.id, NAMESPACE, p.question.category, tuple(p.segments)) for p in pending]


def _answer_all(model: Any, pending: list[_Pending], config: TopkTraceConfig, eos: int) -> None:
    """Answer each pending question's last input, batched by prompt length."""
    order = sorted(pending, key=lambda p: len(p.prompt()))
    start, done = time.perf_counter(), 0
    for at in range(0, len(order), config.batch):
        batch = order[at : at + config.batch]
        answers = greedy_with_topk(model, [p.prompt() for p in batch], config.max_new_tokens, eos, config.k)
        for p, (tokens, topk) in zip(batch, answers, strict=True):
            p.segments.append(Segment("output", tokens, topk))
            done += tokens.size
        logger.info(
            "%d/%d answered, %d tokens, %.1f tokens/s",
            at + len(batch),
            len(order),
            done,
            done / (time.perf_counter() - start),
        )


def _encode(tokenizer: Any, users: tuple[str, ...], answers: list[str]) -> np.ndarray:
    messages = []
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return np.asarray(ids, dtype=np.int32)


def _next_turn(tokenizer: Any, p: _Pending, eos: int) -> np.ndarray:
    """The tokens that follow the model's own first answer in the chat template for the second
    user turn: the template's text after that answer (after its EOS when the answer has one)."""
    answer = p.segments[-1].tokens
    ended = bool(answer.size) and int(answer[-1]) == eos
    text = tokenizer.decode(answer[:-1] if ended else answer)
    users = p.question.turns[:2]
    messages = [{"role": "user", "content": users[0]}]
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": users[1]}]
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not full.startswith(head + text):
        raise ValueError(f"{p.question.id}: the chat template does not extend the first turn")
    tail = full[len(head) + len(text) :]
    if ended:
        tail = tail.removeprefix(tokenizer.eos_token)
    return np.asarray(tokenizer.encode(tail, add_special_tokens=False), dtype=np.int32)


def write_atomic(conversations: list[Conversation], out: Path) -> None:
    """The trace at ``out``, whole or not at all (gzip when its name ends in ``.gz``)."""
    tmp = out.with_name(f"{out.stem}.tmp{out.suffix}")
    write_traces(conversations, tmp)
    os.replace(tmp, out)


def stats(conversations: list[Conversation]) -> dict[str, Any]:
    """Answers, output tokens and answers per category of a trace."""
    by_category: dict[str, list[int]] = {}
    for c in conversations:
        outputs = [s for s in c.segments if s.kind == "output"]
        row = by_category.setdefault(c.category, [0, 0])
        row[0] += len(outputs)
        row[1] += sum(s.tokens.size for s in outputs)
    return {
        "conversations": len(conversations),
        "answers": sum(a for a, _ in by_category.values()),
        "output_tokens": sum(t for _, t in by_category.values()),
        "by_category": {c: {"answers": a, "tokens": t} for c, (a, t) in sorted(by_category.items())},
    }

"""The prompts of the engine benchmark (``bash deploy/bench_engines.sh``), as SmolLM2
chat-template token ids, written once to a JSON file so every engine runs the very same ids.

Two workloads:

- ``spec_bench``: Spec-Bench first turns, a few per task group, round-robin over the groups (the
  trace's Llama-2 ids decoded to the question, as ``bench-generate`` does, then put in the target's
  chat template).
- ``agent_repeat``: agent tasks asked again, as a fleet sees them. The first turn of a few
  SWE-agent trajectories (system prompt and user turn, the user turn cut to ``max_user_tokens``
  tokens so the prompt fits a small context: its head, the task, and its tail, the
  instructions every task ends with and the model answers), asked in two passes: every
  task once (pass 1), then every task again, unchanged (pass 2). A cache shared across requests
  can only pay in pass 2; both passes are measured and reported.

    python -m benchmarks.engine_workloads --out prompts.json [--per-group 3] [--agent-tasks 4]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

SPEC_BENCH, AGENT_REPEAT = "spec_bench", "agent_repeat"
WORKLOADS = (SPEC_BENCH, AGENT_REPEAT)
PASSES = 2  # agent_repeat: every task asked in pass 1, then again in pass 2


@dataclass(frozen=True)
class EnginePrompt:
    """One request of a workload: its group (a Spec-Bench task group, or ``pass1``/``pass2``),
    a name (the trace's conversation id) and its token ids, ready for the assistant's turn."""

    workload: str
    group: str
    name: str
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; known: {WORKLOADS}")
        if not self.ids or any(not isinstance(t, int) or t < 0 for t in self.ids):
            raise ValueError(f"{self.name}: ids must be a non-empty list of token ids >= 0")


def round_robin(groups: dict[str, list[Any]]) -> list[Any]:
    """The groups' items interleaved: the first of every group, then the second, ...

    >>> round_robin({"a": [1, 2, 3], "b": [4]})
    [1, 4, 2, 3]
    """
    return [x for batch in zip_longest(*groups.values()) for x in batch if x is not None]


def passes(tasks: Sequence[tuple[str, tuple[int, ...]]], n: int = PASSES) -> list[EnginePrompt]:
    """``tasks`` (name, ids) asked ``n`` times: all of them in pass 1, then all again.

    >>> [(p.group, p.name) for p in passes([("t1", (1,)), ("t2", (2,))])]
    [('pass1', 't1'), ('pass1', 't2'), ('pass2', 't1'), ('pass2', 't2')]
    """
    return [EnginePrompt(AGENT_REPEAT, f"pass{r + 1}", name, ids) for r in range(n) for name, ids in tasks]


def head_and_tail(ids: Sequence[int], n: int, head_share: float = 0.25) -> list[int]:
    """At most ``n`` of ``ids``: the first ``head_share`` of ``n`` and the last of them, the
    middle dropped.

    >>> head_and_tail(list(range(10)), 4)
    [0, 7, 8, 9]
    >>> head_and_tail([1, 2], 4)
    [1, 2]
    """
    if len(ids) <= n:
        return list(ids)
    head = int(n * head_share)
    return [*ids[:head], *ids[len(ids) - (n - head) :]]


def chat_ids(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> tuple[int, ...]:
    chat = [{"role": role, "content": content} for role, content in messages]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    return tuple(int(i) for i in ids)


def spec_bench(traces: Path, llama_tokenizer: Path, tokenizer: Any, per_group: int) -> list[EnginePrompt]:
    """``per_group`` Spec-Bench first turns per task group, spread over the group,
    round-robin over the groups."""
    from benchmarks.generate_bench import spec_bench_prompts

    groups: dict[str, list[EnginePrompt]] = {}
    for p in spec_bench_prompts(traces, llama_tokenizer, per_group):
        prompt = EnginePrompt(SPEC_BENCH, p.category, p.name, chat_ids(tokenizer, p.messages))
        groups.setdefault(p.category, []).append(prompt)
    return round_robin(groups)


def _conversations(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def agent_repeat(traces: Path, tokenizer: Any, tasks: int, max_user_tokens: int) -> list[EnginePrompt]:
    """``tasks`` SWE-agent first turns spread over the trace (the user turn cut to
    ``max_user_tokens`` tokens, see :func:`head_and_tail`), in two passes (see the module
    docstring)."""
    from benchmarks.generate_bench import chatml_turns, pick

    chosen = []
    for conv in pick(list(_conversations(traces)), tasks):
        turns = chatml_turns(tokenizer.decode(conv["segments"][0]["tokens"]))
        system = next(c for r, c in turns if r == "system")
        user = next(c for r, c in turns if r == "user")
        user_ids = head_and_tail(tokenizer.encode(user, add_special_tokens=False), max_user_tokens)
        messages = (("system", system), ("user", tokenizer.decode(user_ids)))
        chosen.append((conv["id"], chat_ids(tokenizer, messages)))
    return passes(chosen)


def build(
    data: Path, *, per_group: int, agent_tasks: int, max_user_tokens: int = 1500
) -> dict[str, list[EnginePrompt]]:
    """Both workloads from the shared data folder (``traces/`` and ``tokenizers/``)."""
    from transformers import AutoTokenizer

    if per_group < 1 or agent_tasks < 1 or max_user_tokens < 1:
        raise ValueError("per_group, agent_tasks and max_user_tokens must be >= 1")
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizers/smollm2")
    traces, llama = data / "traces", data / "tokenizers/llama2-spm"
    return {
        SPEC_BENCH: spec_bench(traces / "spec_bench_vicuna7b.jsonl.gz", llama, tokenizer, per_group),
        AGENT_REPEAT: agent_repeat(traces / "swe_agent_dev.jsonl.gz", tokenizer, agent_tasks, max_user_tokens),
    }


def save(workloads: dict[str, list[EnginePrompt]], path: Path) -> None:
    """Write the workloads as JSON (through a temporary file: a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({w: [asdict(p) for p in ps] for w, ps in workloads.items()}))
    tmp.replace(path)


def load(path: Path, vocab_size: int | None = None) -> dict[str, list[EnginePrompt]]:
    """The workloads :func:`save` wrote; ``ValueError`` on anything else (an unknown workload, a
    prompt without ids, an id outside ``[0, vocab_size)``).

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "w.json"
    >>> save({SPEC_BENCH: [EnginePrompt(SPEC_BENCH, "qa", "q/1", (1, 2))]}, path)
    >>> load(path)[SPEC_BENCH][0].ids
    (1, 2)
    """
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected an object of workloads")
    out: dict[str, list[EnginePrompt]] = {}
    for workload, prompts in raw.items():
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"{path}: workload {workload!r} has no prompts")
        out[workload] = []
        for p in prompts:
            if p.get("workload") != workload:
                raise ValueError(f"{path}: prompt {p.get('name')!r} of {p.get('workload')!r} listed under {workload!r}")
            prompt = EnginePrompt(workload, str(p["group"]), str(p["name"]), tuple(p["ids"]))
            if vocab_size is not None and max(prompt.ids) >= vocab_size:
                raise ValueError(f"{prompt.name}: id {max(prompt.ids)} is outside the vocabulary [0, {vocab_size})")
            out[workload].append(prompt)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    default = Path(os.environ.get("DRAFTCACHE_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--data", type=Path, default=default, help="the shared data folder (traces/, tokenizers/)")
    p.add_argument("--per-group", type=int, default=3, help="Spec-Bench first turns per task group (six groups)")
    p.add_argument("--agent-tasks", type=int, default=4, help="SWE-agent tasks, each asked in two passes")
    p.add_argument("--max-user-tokens", type=int, default=1500, help="an agent task's user turn is cut to N")
    a = p.parse_args(argv)
    workloads = build(a.data, per_group=a.per_group, agent_tasks=a.agent_tasks, max_user_tokens=a.max_user_tokens)
    save(workloads, a.out)
    sizes = {w: [len(p.ids) for p in ps] for w, ps in workloads.items()}
    print(json.dumps({"out": str(a.out), "prompt_tokens": sizes}))


if __name__ == "__main__":
    main()

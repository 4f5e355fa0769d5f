"""The engine benchmark's prompts, built from the real traces and the SmolLM2 tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine_workloads import AGENT_REPEAT, SPEC_BENCH, EnginePrompt, build, load, save

VOCAB = 49152  # SmolLM2


@pytest.fixture(scope="module")
def workloads(shared_data: Path) -> dict[str, list[EnginePrompt]]:
    return build(shared_data, per_group=2, agent_tasks=3, max_user_tokens=300)


def test_spec_bench_takes_each_group_in_turn(workloads: dict[str, list[EnginePrompt]], shared_data: Path) -> None:
    prompts = workloads[SPEC_BENCH]
    groups = [p.group for p in prompts]
    assert len(set(groups)) == 6 and len(prompts) == 12  # Spec-Bench's six task groups, two each
    assert groups[:6] == groups[6:] and len(set(groups[:6])) == 6  # round-robin, not group after group
    assert len({p.name for p in prompts}) == 12
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers/smollm2")
    text = tokenizer.decode(list(prompts[0].ids))
    # One user turn in SmolLM2's chat template, open for the answer; the question is the
    # Vicuna turn's, without its template.
    assert text.count("<|im_start|>user\n") == 1 and text.endswith("<|im_start|>assistant\n")
    assert "USER:" not in text and "ASSISTANT:" not in text


def test_agent_tasks_are_asked_again_unchanged(workloads: dict[str, list[EnginePrompt]]) -> None:
    prompts = workloads[AGENT_REPEAT]
    first, second = prompts[:3], prompts[3:]
    assert [p.group for p in first] == ["pass1"] * 3 and [p.group for p in second] == ["pass2"] * 3
    assert [p.name for p in first] == [p.name for p in second] and len({p.name for p in first}) == 3
    assert [p.ids for p in first] == [p.ids for p in second]  # the same request, token for token
    assert len({p.ids for p in first}) == 3
    # The user turn is cut to 300 tokens (the system turn and the chat template add little more).
    assert all(len(p.ids) <= 300 + 200 for p in prompts)


def test_agent_prompt_keeps_the_task_and_the_end_of_the_user_turn(shared_data: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers/smollm2")
    (prompt, _) = build(shared_data, per_group=1, agent_tasks=1, max_user_tokens=80)[AGENT_REPEAT]
    text = tokenizer.decode(list(prompt.ids))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant")
    # The task's head (a quarter of the budget), then the turn's end: its middle is dropped.
    user = text[text.index("<|im_start|>user\n") :]
    assert user.startswith("<|im_start|>user\n<pr_description>\nConsider the following PR description")
    assert text.endswith("</instructions><|im_end|>\n<|im_start|>assistant\n")
    assert "in any way on this task after submitting." in user and "## Recommended Workflow" not in user


def test_workloads_round_trip_and_ids_stay_in_the_vocabulary(
    workloads: dict[str, list[EnginePrompt]], tmp_path: Path
) -> None:
    path = tmp_path / "prompts.json"
    save(workloads, path)
    assert load(path, VOCAB) == workloads
    assert max(max(p.ids) for ps in workloads.values() for p in ps) < VOCAB


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"spec_bench": []}, "has no prompts"),
        ({"other": [{"workload": "other", "group": "g", "name": "n", "ids": [1]}]}, "unknown workload"),
        ({"spec_bench": [{"workload": "spec_bench", "group": "g", "name": "n", "ids": []}]}, "non-empty"),
        ({"spec_bench": [{"workload": "spec_bench", "group": "g", "name": "n", "ids": [1, -2]}]}, ">= 0"),
        ({"spec_bench": [{"workload": "spec_bench", "group": "g", "name": "n", "ids": [VOCAB]}]}, "outside the vocab"),
        ({"spec_bench": [{"workload": "agent_repeat", "group": "g", "name": "n", "ids": [1]}]}, "listed under"),
    ],
)
def test_load_refuses_a_malformed_file(tmp_path: Path, content: dict, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load(path, VOCAB)

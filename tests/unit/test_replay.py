import gzip
import json
import logging
from pathlib import Path

import numpy as np
import pytest

import benchmarks
from benchmarks.baselines import EngineDrafter, PromptLookupDrafter
from benchmarks.replay import ReplayStats, replay
from benchmarks.replay_bench import BestChain, ReplayConfig, drafters, run_replay
from benchmarks.traces import Conversation, Segment, read_traces
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _conv(cid, *segments, category="all"):
    return Conversation(cid, "ns", category, tuple(Segment(kind, _a(toks)) for kind, toks in segments))


# Prompt lookup on [1 2 3 4 1 2] drafts "3 4 1 2" ("1 2" occurred at 0).
FULL = _conv("full", ("input", [1, 2, 3, 4, 1, 2]), ("output", [3, 4, 1, 2]), category="full")
PARTIAL = _conv("partial", ("input", [1, 2, 3, 4, 1, 2]), ("output", [3, 4, 7, 8]), category="partial")
# Prompt lookup on [1 2 1] drafts "2 1", but the target says 5 then 6.
NEVER = _conv("never", ("input", [1, 2, 1]), ("output", [5, 6]), category="never")


def test_fully_accepted_draft_is_one_step():
    stats = replay([FULL], PromptLookupDrafter())
    # The draft "3 4 1 2" is the whole output: one verification step yields all 4 tokens.
    assert (stats.steps, stats.tokens, stats.requests) == (1, 4, 1)
    assert stats.mat == 4.0
    # 4 tokens were drafted and all 4 accepted, from the chain's CONTEXT tier.
    assert stats.drafted == 4
    assert stats.accepted_by_tier == {"CONTEXT": 4}


def test_partially_accepted_draft():
    stats = replay([PARTIAL], PromptLookupDrafter())
    # Step 1: draft "3 4 1 2", "3 4" accepted + bonus 7. Step 2: "4 7"/"7" never seen, empty
    # draft, bonus 8. Two steps for four tokens.
    assert (stats.steps, stats.tokens) == (2, 4)
    assert stats.mat == 2.0
    # Only the first step drafted anything (4 tokens), 2 of which were accepted.
    assert stats.drafted == 4
    assert stats.accepted_by_tier == {"CONTEXT": 2}


def test_never_accepted_draft():
    stats = replay([NEVER], PromptLookupDrafter())
    # Step 1: draft "2 1" rejected at once, bonus 5. Step 2: nothing repeats, bonus 6.
    assert (stats.steps, stats.tokens) == (2, 2)
    # One token per step: no speed-up.
    assert stats.mat == 1.0
    assert stats.drafted == 2
    assert dict(stats.accepted_by_tier) == {}


def test_totals_and_categories_over_several_conversations():
    stats = replay([FULL, PARTIAL, NEVER], PromptLookupDrafter())
    # 4 + 4 + 2 tokens over 1 + 2 + 2 steps.
    assert (stats.steps, stats.tokens, stats.requests) == (5, 10, 3)
    assert stats.mat == 2.0
    # Per category: [tokens, steps].
    assert dict(stats.by_category) == {"full": [4, 1], "partial": [4, 2], "never": [2, 2]}
    summary = stats.summary()
    assert summary["mat"] == 2.0
    assert summary["mat_by_category"] == {"full": 4.0, "never": 1.0, "partial": 2.0}
    assert summary["drafted_per_step"] == 2.0  # (4 + 4 + 2) drafted / 5 steps
    # One latency sample per step.
    assert len(stats.latencies_us) == 5


def test_progress_after_each_conversation_with_the_totals_so_far():
    seen = []

    def progress(n, stats):
        seen.append((n, stats.steps, stats.tokens))

    replay([FULL, PARTIAL, NEVER], PromptLookupDrafter(), after_conversation=progress)
    assert seen == [(1, 1, 4), (2, 3, 8), (3, 5, 10)]


def test_a_long_replay_logs_its_progress_but_not_past_its_end(caplog):
    caplog.set_level(logging.INFO, logger="benchmarks.replay_bench")
    drafter = PromptLookupDrafter()
    run_replay([FULL, PARTIAL, NEVER], [drafter], progress_every_s=0.0)
    lines = [r.getMessage().removeprefix(f"{drafter.name}: ") for r in caplog.records]
    assert [m.split(",")[0] for m in lines[:-1]] == ["1 of 3 conversations", "2 of 3 conversations"]
    assert "MAT so far 4.000" in lines[0] and "MAT so far 2.667" in lines[1]
    assert lines[-1].startswith("MAT 2.000 in")
    caplog.clear()
    run_replay([FULL, PARTIAL, NEVER], [PromptLookupDrafter()])  # a quick replay: its result only
    assert len(caplog.records) == 1


def test_empty_replay():
    stats = replay([], PromptLookupDrafter())
    # No steps: MAT is defined as 0 rather than dividing by zero.
    assert (stats.steps, stats.mat) == (0, 0.0)
    assert stats.summary()["steps"] == 0


def test_multi_turn_prompt_includes_earlier_output():
    conv = _conv("mt", ("input", [1, 2, 3]), ("output", [9]), ("input", [1, 2]), ("output", [3, 9]))
    stats = replay([conv], PromptLookupDrafter(num_tokens=2))
    # Turn 1: nothing repeats, one step for 9. Turn 2: prompt [1 2 3 9 1 2], "1 2" drafts "3 9",
    # fully accepted: one step.
    assert (stats.steps, stats.tokens, stats.requests) == (2, 3, 2)
    assert stats.mat == 1.5


def test_engine_replays_identical_request_in_one_step():
    engine = NamespaceDrafter(Namespace(name="ns", vocab_size=100), DrafterConfig())
    conv = _conv("x", ("input", [10, 11, 12, 13, 14]), ("output", [20, 21, 22, 23, 24, 25]))
    stats = replay([conv, conv], EngineDrafter(engine, DraftParams()))
    # First time: nothing repeats and nothing is remembered, so 6 steps for 6 tokens. Second time:
    # the exact-prompt tier drafts the whole previous response, accepted in one step.
    assert (stats.steps, stats.tokens, stats.requests) == (7, 12, 2)
    assert stats.accepted_by_tier["EXACT"] == 6


def test_drafting_ahead_counts_where_each_hit_was_won_or_lost():
    convs = read_traces(Path(benchmarks.__file__).parent / "data" / "spec_bench_smollm2_topk.jsonl.gz", limit=16)
    engine = NamespaceDrafter(Namespace(name="smollm2", vocab_size=49152), DrafterConfig())
    stats = replay(convs, EngineDrafter(engine, DraftParams(), lookahead=4))
    # Every step's outcome is scored against what was drafted ahead for the tree it verified: a
    # hit is a bonus token among the roots drafted at the right stopping point, served at the
    # next step unless the request ended there.
    assert 0 < stats.ahead_hits <= stats.ahead_bonus <= stats.ahead_hits + stats.requests
    assert stats.ahead_bonus < stats.ahead_points < stats.steps
    summary = stats.summary()
    assert summary["prespeculation_point_rate"] == round(stats.ahead_points / stats.steps, 4)
    assert summary["prespeculation_bonus_rate"] == round(stats.ahead_bonus / stats.ahead_points, 4)


def test_chains_drafted_ahead_are_counted_and_served_as_chains():
    convs = read_traces(Path(benchmarks.__file__).parent / "data" / "spec_bench_smollm2_topk.jsonl.gz", limit=16)
    k = 8
    engine = NamespaceDrafter(Namespace(name="smollm2", vocab_size=49152), DrafterConfig())
    stats = replay(convs, _Chains(EngineDrafter(engine, DraftParams(chain=k), lookahead=4), k))
    # Outcomes of the chains were drafted ahead for, and what a hit serves is a chain too.
    assert 0 < stats.ahead_hits <= stats.ahead_bonus <= stats.ahead_hits + stats.requests
    assert stats.ahead_bonus < stats.ahead_points < stats.steps
    assert stats.drafted <= k * stats.steps


class _Chains:
    """A drafter whose every proposal must be a chain of at most ``k`` tokens."""

    def __init__(self, inner: EngineDrafter, k: int) -> None:
        self.inner, self.k = inner, k

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self) -> DraftTree:
        tree = self.inner.propose()
        assert len(tree) <= self.k and tree.parents.tolist() == list(range(-1, len(tree) - 1))
        return tree


class _Recorder:
    """Proposes nothing; records what replay asks of it."""

    name = "recorder"

    def __init__(self):
        self.calls = []

    def start(self, prompt):
        self.calls.append(("start", prompt.tolist(), str(prompt.dtype)))

    def propose(self):
        return DraftTree.empty()

    def advance(self, tokens):
        self.calls.append(("advance", tokens.tolist()))

    def finish(self, commit_from):
        self.calls.append(("finish", commit_from))


def test_replay_protocol_prompts_steps_and_commit_offsets():
    rec = _Recorder()
    conv = _conv("p", ("input", [1, 2]), ("output", [3, 4]), ("input", [5]), ("output", [6]))
    stats = replay([conv], rec)
    assert rec.calls == [
        # Turn 1 sees the first input as its prompt and, with empty drafts, one token per step.
        ("start", [1, 2], "int32"),
        ("advance", [3]),
        ("advance", [4]),
        # Nothing of this conversation was committed before.
        ("finish", 0),
        # Turn 2's prompt is everything so far; the first 4 tokens were committed by turn 1.
        ("start", [1, 2, 3, 4, 5], "int32"),
        ("advance", [6]),
        ("finish", 4),
    ]
    # Every step yields exactly one token.
    assert stats.mat == 1.0


def test_output_without_input_starts_from_empty_prompt():
    rec = _Recorder()
    replay([_conv("o", ("output", [7]))], rec)
    # No input segment: an empty int32 prompt.
    assert rec.calls[0] == ("start", [], "int32")


# -- traces ------------------------------------------------------------------------------------


def _write_gz(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


CONV_A = {
    "id": "a",
    "namespace": "llama",
    "category": "code",
    "segments": [{"kind": "input", "tokens": [1, 2]}, {"kind": "output", "tokens": [3, 4, 5]}],
}
CONV_B = {"namespace": "llama", "segments": [{"kind": "output", "tokens": [7]}]}


def test_read_traces_gz(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    _write_gz(path, [json.dumps(CONV_A), "", json.dumps(CONV_B)])
    convs = read_traces(path)
    # Two conversations; the blank line is skipped.
    assert [c.id for c in convs] == ["a", f"{path}:3"]
    a, b = convs
    assert (a.namespace, a.category) == ("llama", "code")
    assert [(s.kind, s.tokens.tolist()) for s in a.segments] == [("input", [1, 2]), ("output", [3, 4, 5])]
    # Tokens arrive as int32 arrays.
    assert a.segments[0].tokens.dtype == np.int32
    # Only output segments count as output tokens.
    assert a.output_tokens == 3
    # A missing category defaults to "all".
    assert b.category == "all"


def test_read_traces_plain_jsonl_and_limit(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(CONV_A) + "\n" + json.dumps(CONV_B) + "\n")
    # Uncompressed files work too; limit stops after that many lines.
    assert [c.id for c in read_traces(path, limit=1)] == ["a"]
    assert len(read_traces(path)) == 2


def test_read_traces_limit_counts_conversations_not_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(CONV_A) + "\n\n" + json.dumps(CONV_B) + "\n")
    # A blank line between conversations is not one of the first two conversations.
    assert len(read_traces(path, limit=2)) == 2


def test_read_traces_invalid_json_names_line(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    _write_gz(path, [json.dumps(CONV_A), "{not json"])
    # The error names the file and the line (2).
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz:2: malformed"):
        read_traces(path)


@pytest.mark.parametrize(
    "obj",
    [
        {"segments": []},  # no namespace
        {"namespace": "x"},  # no segments
        {"namespace": "x", "segments": [{"kind": "prompt", "tokens": [1]}]},  # unknown kind
        {"namespace": "x", "segments": [{"kind": "input", "tokens": [1, -2]}]},  # negative id
        {"namespace": "x", "segments": [{"kind": "input", "tokens": [[1]]}]},  # nested tokens
        {"namespace": "x", "segments": [{"kind": "input", "tokens": [2**31 - 1]}]},  # the separator id
        # ids that are not integers: numpy would read each as some other id
        {"namespace": "x", "segments": [{"kind": "input", "tokens": [1.7]}, {"kind": "output", "tokens": [3]}]},
        {"namespace": "x", "segments": [{"kind": "input", "tokens": ["12"]}, {"kind": "output", "tokens": [3]}]},
        {"namespace": "x", "segments": [{"kind": "input", "tokens": [True, 2]}, {"kind": "output", "tokens": [3]}]},
        {"namespace": "x", "segments": [{"kind": "output", "tokens": [3, 4], "topk": [[3.5], [4]]}]},
        {"namespace": "x", "segments": [{"kind": "input", "tokens": "12"}, {"kind": "output", "tokens": [3]}]},
        {"namespace": "x", "segments": {"kind": "output", "tokens": [3]}},  # segments not a list
        [CONV_A],  # not an object
        # an empty output's malformed top-k is malformed all the same
        {"namespace": "x", "segments": [{"kind": "output", "tokens": [], "topk": [[1]]}]},
    ],
)
def test_read_traces_malformed_conversation_names_line(tmp_path, obj):
    path = tmp_path / "bad.jsonl.gz"
    _write_gz(path, [json.dumps(CONV_A), json.dumps(CONV_B), json.dumps(obj)])
    # Each of these is a malformed conversation on line 3.
    with pytest.raises(ValueError, match=r":3: malformed"):
        read_traces(path)


def test_read_traces_corrupt_gzip(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(b"this is not gzip data")
    # An unreadable file is a ValueError, not an OSError.
    with pytest.raises(ValueError, match="unreadable"):
        read_traces(path)


def test_read_traces_truncated_gzip(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    _write_gz(path, [json.dumps(CONV_A)] * 50)
    path.write_bytes(path.read_bytes()[:-20])
    # A cut-off gzip stream is reported as unreadable.
    with pytest.raises(ValueError, match="unreadable"):
        read_traces(path)


def test_merged_stats_add_up_disjoint_replays():
    a, b = ReplayStats("d"), ReplayStats("d")
    a.steps, a.tokens, a.drafted, a.requests, a.ahead_hits = 4, 10, 40, 1, 2
    a.ahead_points, a.ahead_bonus, b.ahead_points, b.ahead_bonus = 3, 2, 4, 1
    b.steps, b.tokens, b.drafted, b.requests = 6, 20, 30, 2
    a.by_category["x"] = [10, 4]
    b.by_category["x"] = [5, 3]
    b.by_category["y"] = [15, 3]
    a.accepted_by_tier["CONTEXT"] = 3
    b.accepted_by_tier["CONTEXT"] = 4
    b.accepted_by_tier["PRIOR"] = 1
    a.latencies_us, b.latencies_us = [1.0, 2.0], [3.0]
    m = ReplayStats.merged([a, b])
    assert (m.name, m.steps, m.tokens, m.drafted, m.requests, m.ahead_hits) == ("d", 10, 30, 70, 3, 2)
    assert m.mat == 3.0
    assert (m.ahead_points, m.ahead_bonus) == (7, 3)
    assert dict(m.by_category) == {"x": [15, 7], "y": [15, 3]}
    assert dict(m.accepted_by_tier) == {"CONTEXT": 7, "PRIOR": 1}
    assert m.latencies_us == [1.0, 2.0, 3.0]
    assert a.steps == 4 and dict(a.by_category) == {"x": [10, 4]}  # the parts stay as they were
    with pytest.raises(ValueError):
        ReplayStats.merged([])


# -- chain replay ------------------------------------------------------------------------------


def test_best_chain_cuts_a_tree_drafter_to_k_tokens():
    stats = replay([FULL], BestChain(PromptLookupDrafter(), 2))
    # Prompt lookup drafts "3 4 1 2"; cut to 2 tokens, each step yields 2 + bonus: "3 4 1", "2".
    assert (stats.steps, stats.tokens) == (2, 4)
    # 2 tokens proposed at each step (the second: "2 3" after "3 4 1", where the output ends).
    assert stats.drafted == 4


def test_chain_replay_proposes_at_most_k_tokens_per_step():
    config = ReplayConfig(params=DraftParams(chain=2), baselines=("prompt-lookup",), chain=2)
    conv = _conv("c", ("input", [1, 2, 3, 4, 5, 6, 1, 2]), ("output", [3, 4, 5, 6, 9]))
    drafters_ = drafters(Namespace(name="ns", vocab_size=100), config, None)
    # Ours in chain mode, our tree cut to its best path, and prompt lookup drafting 2 tokens.
    assert [d.name for d in drafters_] == ["draftcache", "draftcache-tree/best_chain(2)", "prompt-lookup(n=1..3,k=2)"]
    for d in drafters_:
        stats = replay([conv], d)
        # "1 2" was followed by "3 4 5 6": two steps of 2 + bonus ("3 4 5", "6 9").
        assert (stats.steps, stats.tokens) == (2, 5), d.name
        # Never more than 2 tokens proposed at a step.
        assert stats.drafted <= 2 * stats.steps, d.name


@pytest.mark.parametrize("kw", [{"chain": 2}, {"chain": 3, "params": DraftParams(chain=2)}])
def test_chain_replay_config_is_checked(kw):
    # A chain length the params disagree with is refused.
    with pytest.raises(ValueError):
        ReplayConfig(**kw)


def test_requests_that_produced_nothing_are_left_out_and_counted(tmp_path, caplog):
    """A request that produced nothing (its output segment empty: the model ended at once and
    its end token was not logged) has no step to replay: it is left out of its conversation, a
    conversation left with no request is left out whole, and a warning counts both. A file of
    real traffic is not refused for them."""
    path = tmp_path / "t.jsonl.gz"
    nothing = {
        "id": "n",
        "namespace": "x",
        "segments": [{"kind": "input", "tokens": [1, 2]}, {"kind": "output", "tokens": []}],
    }
    partly = {
        "id": "p",
        "namespace": "x",
        "segments": [
            {"kind": "input", "tokens": [1, 2]},
            {"kind": "output", "tokens": []},
            {"kind": "input", "tokens": [3]},
            {"kind": "output", "tokens": [4, 5]},
        ],
    }
    no_request = {"id": "q", "namespace": "x", "segments": [{"kind": "input", "tokens": [1]}]}
    lines = [json.dumps(o) for o in (CONV_A, nothing, partly, no_request, {"namespace": "x", "segments": []}, CONV_B)]
    _write_gz(path, lines)
    with caplog.at_level(logging.WARNING, logger="benchmarks.traces"):
        convs = read_traces(path)
    assert [c.id for c in convs] == [CONV_A["id"], "p", f"{path}:6"]  # CONV_B has no id: its line names it
    (p,) = [c for c in convs if c.id == "p"]
    assert [(s.kind, s.tokens.tolist()) for s in p.segments] == [("input", [1, 2]), ("input", [3]), ("output", [4, 5])]
    assert "2 output segments without tokens and 3 conversations without a request left out" in caplog.text
    assert [c.id for c in read_traces(path, limit=2)] == [CONV_A["id"], "p"]  # the limit counts what is replayed

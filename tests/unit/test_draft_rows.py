"""A draft model's rows in replay: the file checked against the trace it is used with, the
model's greedy chains, and ours beside them (:mod:`benchmarks.draft_rows`,
:mod:`benchmarks.draft_model_replay`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.baselines import EngineDrafter
from benchmarks.draft_model_replay import DraftModelChain, WithDraftModel
from benchmarks.draft_rows import DraftRows, SegmentRows, fingerprint, windows, write_rows
from benchmarks.replay import replay
from benchmarks.replay_bench import ReplayConfig, drafters
from benchmarks.traces import Conversation, Segment
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.tokens import Namespace

VOCAB = 50
OUTPUT = [3, 4, 5, 6, 7, 8]
CONV = Conversation(
    "c", "toy", "all", (Segment("input", np.array([1, 2], np.int32)), Segment("output", np.array(OUTPUT, np.int32)))
)


def _rows(ids: list[int], probs: list[float]) -> SegmentRows:
    """One-column rows: the model's guess at each output position and how sure it is."""
    return SegmentRows(np.array(ids, np.int32)[:, None], np.log(np.array(probs, np.float32))[:, None])


def _write(path: Path, rows: dict[str, list[SegmentRows]], vocab: int = VOCAB) -> Path:
    write_rows(path, rows, {"model": "toy", "vocab_size": vocab})
    return path


@pytest.mark.parametrize("n,window,context", [(1, 4, 1), (2, 4, 0), (9, 4, 3), (100, 16, 4), (100, 7, 6)])
def test_windows_predict_every_position_once_with_enough_context(n: int, window: int, context: int) -> None:
    predicted = []
    for start, end, first in windows(n, window, context):
        assert end - start <= window and first - start == (0 if start == 0 else context)
        predicted += [p for p in range(first + 1, end + 1) if p < n]
    assert predicted == list(range(1, n))


@pytest.mark.parametrize("context", [-1, 4, 5])
def test_windows_refuse_context_outside_the_window(context: int) -> None:
    with pytest.raises(ValueError, match="context"):
        windows(10, 4, context)


def test_rows_round_trip_and_pair_with_their_conversation(tmp_path: Path) -> None:
    rows = _rows([3, 4, 9, 6, 7, 8], [0.9, 0.8, 0.5, 0.4, 0.3, 0.2])
    path = _write(tmp_path / "r.npz", {fingerprint(CONV): [rows]})
    back = DraftRows(path)
    assert back.vocab_size == VOCAB and back.meta["model"] == "toy"
    (got,) = back.requests([CONV])
    assert got.ids.tolist() == rows.ids.tolist()
    np.testing.assert_allclose(got.logp, rows.logp, atol=1e-3)  # kept as float16
    assert got.chain(1, 3).tolist() == [4, 9, 6] and got.first_prob(0) == pytest.approx(0.9, abs=1e-3)


def _other(tokens: list[int]) -> Conversation:
    return Conversation(
        "c", "toy", "all", (Segment("input", np.array([1, 2], np.int32)), Segment("output", np.array(tokens, np.int32)))
    )


@pytest.mark.parametrize(
    "rows,vocab,message",
    [
        ({}, VOCAB, "no rows for conversation"),
        ({fingerprint(CONV): []}, VOCAB, "has 1 outputs"),
        ({fingerprint(CONV): [_rows([3, 4], [0.5, 0.5])]}, VOCAB, "shape"),
        ({fingerprint(CONV): [_rows([3, 4, 5, 6, 7, 50], [0.5] * 6)]}, VOCAB, "ids must be"),
        ({fingerprint(CONV): [_rows([3, 4, 5, 6, 7, -2], [0.5] * 6)]}, VOCAB, "ids must be"),
        ({fingerprint(CONV): [_rows([3, 4, 5, 6, 7, 8], [0.5] * 5 + [2.0])]}, VOCAB, "log-probs"),
        ({fingerprint(CONV): [_rows([3, 4, 5, 6, 7, 8], [0.5] * 6)]}, 0, "vocabulary size"),
    ],
)
def test_rows_that_do_not_fit_are_refused(tmp_path: Path, rows: dict, vocab: int, message: str) -> None:
    path = _write(tmp_path / "r.npz", rows, vocab)
    with pytest.raises(ValueError, match=message):
        DraftRows(path).requests([CONV])


def test_rows_of_another_trace_or_no_file_are_refused(tmp_path: Path) -> None:
    # One token changed in the output: another conversation, whatever its id.
    path = _write(tmp_path / "r.npz", {fingerprint(_other([3, 4, 5, 6, 7, 9])): [_rows(OUTPUT, [0.5] * 6)]})
    with pytest.raises(ValueError, match="no rows for conversation 'c'"):
        DraftRows(path).requests([CONV])
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a draft rows file"):
        DraftRows(tmp_path / "junk.npz")


def test_model_chains_are_accepted_up_to_the_models_first_wrong_guess() -> None:
    # Right at 0, 1, 3, 4, 5; wrong at 2 (9 for 5).
    rows = _rows([3, 4, 9, 6, 7, 8], [0.9] * 6)
    stats = replay([CONV], DraftModelChain([rows], 4))
    # Step 1 proposes 3 4 9 6: 3 4 accepted, bonus 5. Step 2 at 3: proposes 6 7 8, all taken.
    assert (stats.steps, stats.mat, stats.drafted) == (2, 3.0, 7)


def test_model_rows_run_out_with_a_clear_error() -> None:
    d = DraftModelChain([_rows(OUTPUT, [0.9] * 6)], 4)
    d.start(np.zeros(0, np.int32))
    d.finish(0)
    with pytest.raises(ValueError, match="draft rows for 1 requests"):
        d.start(np.zeros(0, np.int32))


def _engine() -> EngineDrafter:
    return EngineDrafter(
        NamespaceDrafter(Namespace(name="toy", vocab_size=VOCAB), DrafterConfig()), DraftParams(budget=8, chain=4)
    )


def test_ours_beside_the_model_takes_the_chain_whose_first_token_is_likelier() -> None:
    prompt = np.array([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], np.int32)  # ours copies "3 4 5 6" after "1 2"
    ours = _engine()
    ours.start(prompt)
    own = ours.propose()
    assert own.tokens.tolist() == [3, 4, 5, 6]
    chance = float(own.scores[0])  # its first node's calibrated reach
    assert 0.0 < chance < 1.0
    for prob, expected in ((chance * 0.9, own.tokens.tolist()), (min(1.0, chance * 1.1), [3, 4, 9, 6])):
        mixed = WithDraftModel(_engine(), [_rows([3, 4, 9, 6, 7, 8], [prob] * 6)], 4)
        mixed.start(prompt)
        assert mixed.propose().tokens.tolist() == expected, prob
        assert mixed.model_steps == (expected != own.tokens.tolist())
    # Where ours proposes nothing, the model's chain however unsure.
    mixed = WithDraftModel(_engine(), [_rows([3, 4, 9, 6, 7, 8], [0.01] * 6)], 4)
    mixed.start(np.array([1, 2], np.int32))
    assert mixed.propose().tokens.tolist() == [3, 4, 9, 6]


def test_ours_beside_the_model_replays_every_token_and_keeps_its_engine_in_step() -> None:
    convs = [CONV, _other([3, 4, 5, 6, 7, 8])]  # the same request twice: ours has it whole the second time
    # The model guesses nothing anywhere: ours every step, even where ours is empty.
    rows = [SegmentRows(np.full((6, 1), -1, np.int32), np.full((6, 1), -np.inf, np.float32))] * 2
    alone = replay(convs, _engine())
    mixed = replay(convs, WithDraftModel(_engine(), rows, 4))
    assert (mixed.tokens, mixed.steps, mixed.mat) == (alone.tokens, alone.steps, alone.mat)
    sure = replay(convs, WithDraftModel(_engine(), [_rows(OUTPUT, [1.0] * 6)] * 2, 4))
    assert sure.steps == 4 and sure.tokens == 12  # the model right everywhere: 4 and 1 a request


def test_replay_adds_the_model_and_the_mix_only_to_in_process_chains() -> None:
    ns = Namespace(name="toy", vocab_size=VOCAB)
    rows = [_rows(OUTPUT, [0.9] * 6)]
    names = [d.name for d in drafters(ns, ReplayConfig(params=DraftParams(chain=4), chain=4), None, (), rows)]
    assert names[-2:] == ["draft-model/greedy(4)", "draftcache+draft-model"]
    with pytest.raises(ValueError, match="chain"):
        drafters(ns, ReplayConfig(), None, (), rows)

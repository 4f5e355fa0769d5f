"""Replay's draft model cut off the trace (:mod:`benchmarks.trace_cut`): the same chains accepted,
the same MAT, for far fewer of the model's reads, across requests that go on where a chain was
cut; and a context that is not the request's is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchmarks.draft_model_replay import LiveDraftModel, LiveWithDraftModel
from benchmarks.replay import replay
from benchmarks.trace_cut import SkipsOffTrace, TraceCut
from benchmarks.traces import Conversation, Segment
from decoder_client.chain_model import ChainModel
from indexer.tree_builder import DraftTree

VOCAB = 50
RNG = np.random.default_rng(7)
TRUTH = [RNG.integers(1, VOCAB, size=n).astype(np.int32) for n in (12, 90, 8, 70)]  # two prompts, two answers


class Patchy(ChainModel):
    """Right about the requests' text except at every fifth position, where it guesses the next
    id up; off the text, a fixed function of what it read. It counts its reads and checks that
    each lands where its cache ends."""

    def __init__(self, k: int) -> None:
        super().__init__(k, VOCAB, None)
        self.seq: list[int] = []
        self.reads = 0
        self.texts = [np.concatenate(TRUTH[:2]).tolist(), np.concatenate(TRUTH).tolist()]

    def _rewind(self, n: int) -> None:
        assert n <= len(self.seq)
        self.seq = self.seq[:n]

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        self.reads += 1
        self.seq += ids.tolist()
        n = len(self.seq)
        text = next((t for t in self.texts if t[:n] == self.seq and n < len(t)), None)
        guess = (text[n] + (n % 5 == 0)) % VOCAB if text is not None else (self.seq[-1] * 7 + n) % VOCAB
        p = np.full(VOCAB, 0.2 / VOCAB)
        p[guess] += 0.8
        return p


class Nothing:
    """A drafter that proposes nothing: beside it, the mix proposes the model's chain every step."""

    name = "nothing"

    def start(self, prompt: np.ndarray) -> None: ...

    def propose(self) -> DraftTree:
        return DraftTree.empty()

    def advance(self, tokens: np.ndarray) -> None: ...

    def finish(self, commit_from: int) -> None: ...


def _conversation() -> Conversation:
    kinds = ("input", "output", "input", "output")
    return Conversation("c", "test", "t", tuple(Segment(k, t) for k, t in zip(kinds, TRUTH, strict=True)))


def _cut(k: int) -> tuple[TraceCut, Patchy, SkipsOffTrace]:
    inner = Patchy(k)
    skips = SkipsOffTrace(inner)
    return TraceCut(skips, skips), inner, skips


@pytest.mark.parametrize("beside", [False, True])
def test_cut_chains_are_accepted_as_the_whole_ones_are(beside: bool) -> None:
    def drafter(model: Any) -> Any:
        return LiveWithDraftModel(Nothing(), model) if beside else LiveDraftModel(model, 8)

    whole = Patchy(8)
    cut, inner, skips = _cut(8)
    full_stats = replay([_conversation()], drafter(whole))
    cut_stats = replay([_conversation()], drafter(cut))
    assert cut_stats.mat == full_stats.mat and cut_stats.steps == full_stats.steps
    assert full_stats.mat > 2  # right four times in five: chains go on, and leave the text
    # Every chain is as long as before; the model read about half as often.
    assert cut_stats.drafted == full_stats.drafted
    assert skips.skipped > 0 and inner.reads + skips.skipped == whole.reads
    assert inner.reads < 0.6 * whole.reads
    # Past the first request's end the model went on into the next one's prompt, which it knows:
    # those skipped ids were read after all, with the next request's.
    assert skips.late > 0


def test_a_context_off_the_revealed_request_is_refused() -> None:
    cut, _, _ = _cut(4)
    cut.reveal(np.concatenate(TRUTH[:2]))
    assert cut.first(TRUTH[0]) is not None
    with pytest.raises(ValueError, match="not a prefix"):
        cut.first(np.array([1, 2, 3], np.int32))


def test_a_second_replay_of_the_same_positions_reads_nothing_again() -> None:
    cut, inner, _ = _cut(8)
    alone = replay([_conversation()], LiveDraftModel(cut, 8))
    reads = inner.reads
    # Beside a drafter with nothing, the mix proposes the model's chain at every step: the same
    # positions, each answered from the first replay's reads.
    beside = replay([_conversation()], LiveWithDraftModel(Nothing(), cut))
    assert beside.mat == alone.mat and inner.reads == reads
    assert cut.remembered == 2 * beside.steps
    # A chain cut elsewhere (another min_prob) at a position read before is read anew.
    assert cut.first(np.concatenate(TRUTH[:3])) is not None and inner.reads == reads
    cut.extend(min_prob=0.5)
    assert inner.reads > reads

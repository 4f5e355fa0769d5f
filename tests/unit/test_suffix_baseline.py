"""SuffixDecoding as a replay baseline, at its best: MAT hand-computed on small traces."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.baselines import suffix_decoding_available
from benchmarks.replay import replay
from benchmarks.replay_bench import ReplayConfig, drafters
from benchmarks.traces import Conversation, Segment
from indexer.drafter import DraftParams
from indexer.tokens import Namespace

needs_suffix_decoding = pytest.mark.skipif(not suffix_decoding_available(), reason="arctic-inference not installed")
NS = Namespace(name="ns", vocab_size=200)


def _conv(category: str, prompt: list[int], output: list[int]) -> Conversation:
    segments = (Segment("input", np.array(prompt, np.int32)), Segment("output", np.array(output, np.int32)))
    return Conversation(category, "ns", category, segments)


def _suffix(chain: int = 0) -> list:
    config = ReplayConfig(
        params=DraftParams(chain=chain), chain=chain, baselines=("suffix-decoding",), include_engine=False
    )
    return drafters(NS, config, None)


@needs_suffix_decoding
def test_its_default_lets_the_budget_bound_a_draft() -> None:
    # The first answer, 20 new tokens, teaches the global tree "10 11 ... 29". The second prompt
    # ends with 10 (a match of one token): at factor 64 SuffixDecoding drafts all 19 tokens that
    # followed, accepted in one step with nothing left for a bonus token. Its vLLM-era factor of 8
    # drafted 8 tokens from a one-token match, then the rest: two steps.
    first = _conv("first", [1, 2], list(range(10, 30)))
    again = _conv("again", [3, 4, 10], list(range(11, 30)))
    (suffix,) = _suffix()
    stats = replay([first, again], suffix)
    assert dict(stats.by_category) == {"first": [20, 20], "again": [19, 1]}
    assert stats.mat == 39 / 21


def test_its_default_factor_is_its_best_for_the_shape_replayed() -> None:
    assert ReplayConfig().suffix_spec_factor == 64.0
    assert ReplayConfig(params=DraftParams(chain=8), chain=8).suffix_spec_factor == 8.0
    assert ReplayConfig(suffix_factor=1.0).suffix_spec_factor == 1.0
    with pytest.raises(ValueError, match="suffix_factor"):
        ReplayConfig(suffix_factor=0.0)


@needs_suffix_decoding
def test_chain_replay_runs_its_own_chain_mode_beside_its_tree_cut() -> None:
    # The history: "5" followed by 20 21 ... six times, and "7 5" followed by 40 41 once. The
    # probe's prompt ends with "7 5". Drafting trees, the one-token match "5" wins on its bushy
    # tree's score, whose best path (20 21) is wrong: two steps. Its own chain mode scores each
    # match length's chain and takes "7 5"'s, 40 41, both accepted with the bonus 99: one step.
    history = [*[5, 20, 21, 22, 23] * 6, 7, 5, 40, 41, 8]
    probe = _conv("probe", [1, 2, 7, 5], [40, 41, 99])
    own, cut = _suffix(chain=2)
    assert own.name.endswith("/chain(2)") and cut.name.endswith("/best_chain(2)")
    for drafter, steps in ((own, 1), (cut, 2)):
        stats = replay([_conv("history", [1], history), probe], drafter)
        assert stats.by_category["probe"] == [3, steps]
        assert stats.drafted <= 2 * stats.steps

"""Speculative sampling over draft trees: the pure acceptance walk on literal trees and probabilities."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from decoder_client.reference_decoder import check_sampling, sample_accept, target_probs

V = 4  # vocabulary of the literal distributions below


def _a(ids: list[int]) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def _p(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _runs(tokens: list[int], parents: list[int], probs: torch.Tensor, n: int = 400) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(0)
    return [sample_accept(_a(tokens), _a(parents), probs, g) for _ in range(n)]


def test_certain_child_is_always_accepted() -> None:
    # The root's distribution puts all its mass on 2, the only child: accepted every time, and
    # the bonus comes from node 0's own row (certain 3).
    probs = _p([0, 0, 1, 0], [0, 0, 0, 1])
    assert set(map(repr, _runs([2], [-1], probs))) == {"([0], 3)"}


def test_impossible_child_is_never_accepted() -> None:
    # p(1) = 0 at the root: never accepted; the bonus follows the root's row (0 or 3, never 1).
    out = _runs([1], [-1], _p([0.5, 0, 0, 0.5], [1, 0, 0, 0]))
    assert all(path == [] for path, _ in out)
    assert {bonus for _, bonus in out} == {0, 3}


def test_rejected_first_child_mass_is_removed_before_the_second() -> None:
    # Root: p = (0.5, 0.5). Child 0 holds token 0; once it is rejected the residual is all on
    # token 1, so the second child is then certain: some child is always accepted.
    out = _runs([0, 1], [-1, -1], _p([0.5, 0.5, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]))
    paths = Counter(tuple(path) for path, _ in out)
    assert set(paths) == {(0,), (1,)}
    assert 0.4 < paths[(0,)] / len(out) < 0.6  # each half of the time
    assert all(bonus == (2 if path == [0] else 3) for path, bonus in out)  # each node's own row


def test_bonus_after_rejections_never_repeats_a_rejected_token() -> None:
    # Both children (tokens 0 and 1) rejected: the bonus comes from the residual, only 2 or 3.
    out = _runs([0, 1], [-1, -1], _p([0.4, 0.3, 0.2, 0.1], [1, 0, 0, 0], [1, 0, 0, 0]), n=2000)
    bonuses = {bonus for path, bonus in out if not path}
    assert bonuses == {2, 3}


def test_duplicate_sibling_is_not_tried_twice() -> None:
    # Two siblings both proposing 0: after the first is rejected, p(0) is 0, so the second never wins.
    out = _runs([0, 0], [-1, -1], _p([0.5, 0.5, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0]))
    assert all(path in ([], [0]) for path, _ in out)


def test_accepted_child_continues_with_its_own_row() -> None:
    # Chain 2 -> 3: the root is certain of 2, node 0 rules 3 out, so the walk stops after node 0
    # and the bonus comes from node 0's row (0 or 1), never from node 1's (certain 2).
    out = _runs([2, 3], [-1, 0], _p([0, 0, 1, 0], [0.5, 0.5, 0, 0], [0, 0, 1, 0]))
    assert all(path == [0] for path, _ in out)
    assert {bonus for _, bonus in out} == {0, 1}


def test_empty_tree_samples_the_root_row() -> None:
    out = _runs([], [], _p([0, 0, 0, 1]))
    assert set(map(repr, out)) == {"([], 3)"}


def test_first_token_follows_the_target_whatever_is_drafted() -> None:
    # The emitted first token (the accepted child's or the bonus) is distributed as the root's
    # row, whether the tree drafts the likely token, an unlikely one, or both in either order.
    root = [0.1, 0.2, 0.3, 0.4]
    probs = _p(root, *([[0.25] * V] * 2))
    for tokens in ([3], [0], [3, 0], [0, 3]):
        n = 6000
        out = _runs(tokens, [-1] * len(tokens), probs, n=n)
        first = Counter(tokens[path[0]] if path else bonus for path, bonus in out)
        freq = [first[t] / n for t in range(V)]
        assert np.allclose(freq, root, atol=0.025), (tokens, freq)


def test_same_generator_seed_gives_the_same_walk() -> None:
    probs = _p([0.3, 0.3, 0.2, 0.2], [0.25] * V, [0.25] * V)
    assert _runs([0, 1], [-1, 0], probs, n=50) == _runs([0, 1], [-1, 0], probs, n=50)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_target_probs_match_transformers_warpers(temperature: float, top_p: float) -> None:
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * 3
    scores = TemperatureLogitsWarper(temperature)(torch.zeros(5, 1, dtype=torch.long), logits)
    if top_p < 1:  # transformers leaves the warper out at 1.0
        scores = TopPLogitsWarper(top_p)(torch.zeros(5, 1, dtype=torch.long), scores)
    assert torch.allclose(target_probs(logits, temperature, top_p), scores.softmax(dim=-1))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.tensor([math.log(0.1), math.log(0.2), math.log(0.3), math.log(0.4)])
    assert (target_probs(logits, 1.0, top_p=0.65) > 0).tolist() == [False, False, True, True]  # 0.4 + 0.3
    assert (target_probs(logits, 1.0, top_p=0.01) > 0).tolist() == [False, False, False, True]  # the top one


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(-0.5, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, 1.5), (1.0, -0.1), (1.0, math.nan)]
)
def test_bad_sampling_settings_are_refused(temperature: float, top_p: float) -> None:
    with pytest.raises(ValueError):
        check_sampling(temperature, top_p, None)


def test_good_sampling_settings_pass() -> None:
    check_sampling(0.0, 1.0, None)
    check_sampling(0.7, 0.9, torch.Generator())

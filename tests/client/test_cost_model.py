"""Cost-aware verification: trees cut to their most profitable prefix, valued by calibrated
acceptance probabilities learned from what the target produced."""

from __future__ import annotations

import numpy as np
import pytest

from decoder_client.cost_model import (
    AcceptanceModel,
    CalibratedDrafter,
    CalibrationConfig,
    CostCurve,
    best_subtree,
    calibrated_table,
    cost_aware,
    node_cells,
    observed,
    path_worth,
    sibling_normalised,
)
from decoder_client.reference_decoder import ReferenceDecoder
from indexer.tree_builder import DraftTree
from tests.client.conftest import greedy_continuation


def _tree(tokens: list[int], parents: list[int], scores: list[float]) -> DraftTree:
    n = len(tokens)
    return DraftTree(
        np.array(tokens, np.int32), np.array(parents, np.int32), np.zeros(n, np.uint8), np.array(scores, np.float32)
    )


FLAT = CostCurve((1, 64), (1.0, 1.0))  # a GPU: verifying 64 costs what 1 does
STEEP = CostCurve((1, 2, 4, 8), (1.0, 2.0, 4.0, 8.0))  # every token costs a full forward


def test_flat_cost_keeps_the_whole_tree() -> None:
    t = _tree([5, 6, 7], [-1, 0, 0], [0.9, 0.3, 0.1])
    # Any extra node adds expected tokens for free.
    assert best_subtree(t, FLAT).tokens.tolist() == [5, 6, 7]


def test_linear_cost_drops_everything_uncertain() -> None:
    t = _tree([5, 6], [-1, 0], [0.9, 0.8])
    # (1 + 0.9) / 2 < 1 / 1: even a 90% guess does not pay for a second full forward.
    assert len(best_subtree(t, STEEP)) == 0


def test_prefix_is_always_a_tree() -> None:
    # The child claims more than its parent; it is worth at most the parent, so it cannot come first.
    t = _tree([5, 6, 7], [-1, 0, -1], [0.2, 0.9, 0.5])
    kept = best_subtree(t, CostCurve((1, 2, 3, 4), (1.0, 1.0, 1.0, 5.0)))
    # Best first: 7 (0.5), 5 (0.2), then 6 (worth 0.2, after its parent); the fourth query token
    # costs 5x, so two nodes are kept: both children of the root.
    assert kept.tokens.tolist() == [5, 7] and kept.parents.tolist() == [-1, -1]


def test_bad_curves_are_rejected() -> None:
    with pytest.raises(ValueError):
        CostCurve((2, 4), (1.0, 2.0))  # must start at one token
    with pytest.raises(ValueError):
        CostCurve((1, 2), (1.0,))


def test_measured_curve_and_lossless_decoding(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    import torch

    model = tiny_llama("sdpa")
    curve = CostCurve.measure(model, context=32, repeats=1)
    assert curve.sizes[0] == 1 and all(s > 0 for s in curve.seconds)
    prompt = [3, 9, 27, 81 % 128, 5, 3, 9]
    with torch.inference_mode():
        reference = greedy_continuation(model, prompt, 12)

    def guess(context: np.ndarray) -> DraftTree:  # a fixed wrong-ish chain: pruning must not change output
        return _tree([1, 2, 3], [-1, 0, 1], [0.9, 0.8, 0.7])

    tokens, _ = ReferenceDecoder(model).generate(prompt, 12, drafter=cost_aware(guess, curve))
    assert tokens == reference


# -- calibration ---------------------------------------------------------------------------

SMALL = CalibrationConfig(score_edges=(0.5,), depth_edges=(2,), prior_strength=2.0, prior_scale=0.5)


def _tiered(tokens: list[int], parents: list[int], scores: list[float], tiers: list[int]) -> DraftTree:
    t = _tree(tokens, parents, scores)
    return DraftTree(t.tokens, t.parents, np.array(tiers, np.uint8), t.scores)


def test_cells_are_tier_depth_and_score_buckets() -> None:
    # SMALL's shape: (7 tiers, 2 depth buckets, 2 score buckets) -> index (tier * 2 + depth) * 2 + score.
    t = _tiered([5, 6, 7], [-1, 0, 1], [0.9, 0.4, 0.6], [1, 1, 3])
    # 5: tier 1, depth 1, high; 6: tier 1, depth 2, low; 7: tier 3, depth 3 (2+ bucket), high.
    assert node_cells(t, t.depths(), SMALL).tolist() == [5, 6, 15]


def test_cold_table_is_a_fraction_of_the_scores() -> None:
    table = calibrated_table(np.zeros(SMALL.shape), np.zeros(SMALL.shape), SMALL)
    # Bucket middles 0.25 and 0.75 at prior_scale 0.5, for every tier and depth.
    assert np.allclose(table[..., 0], 0.125) and np.allclose(table[..., 1], 0.375)


def test_table_learns_per_tier_and_shares_across_tiers() -> None:
    hits, trials = np.zeros(SMALL.shape), np.zeros(SMALL.shape)
    hits[1, 0, 1], trials[1, 0, 1] = 20, 20  # tier 1's confident first tokens were always right
    table = calibrated_table(hits, trials, SMALL)
    pooled = (20 + 2 * 0.375) / (20 + 2)
    assert table[1, 0, 1] == pytest.approx((20 + 2 * pooled) / 22)
    # Another tier with no data of its own leans on the pooled evidence...
    assert table[0, 0, 1] == pytest.approx(pooled)
    # ... and a depth bucket nobody has seen stays at the cold prior.
    assert table[0, 1, 1] == pytest.approx(0.375)


def test_table_never_ranks_a_lower_score_above_a_higher_one() -> None:
    hits, trials = np.zeros(SMALL.shape), np.zeros(SMALL.shape)
    hits[2, 0, 0], trials[2, 0, 0] = 30, 30  # low scores right, high scores wrong
    trials[2, 0, 1] = 30
    table = calibrated_table(hits, trials, SMALL)
    # The low bucket is capped at the high one: evidence against high scores is not ignored.
    assert table[2, 0, 0] == table[2, 0, 1] < 0.1


def test_siblings_share_at_most_certainty_and_worth_multiplies_down_paths() -> None:
    parents = np.array([-1, -1, 0, 2], np.int32)
    q = sibling_normalised(parents, np.array([0.9, 0.6, 0.5, 0.5]))
    assert q.round(3).tolist() == [0.6, 0.4, 0.5, 0.5]  # 0.9 + 0.6 > 1: both scaled by 1 / 1.5
    assert path_worth(parents, q).round(3).tolist() == [0.6, 0.4, 0.3, 0.15]


def test_observed_nodes_hang_off_the_accepted_path() -> None:
    #        root
    #       /    \
    #      0      1
    #      |      |
    #      2      3
    parents, depths = np.array([-1, -1, 0, 1], np.int32), np.array([1, 1, 2, 2])
    # One token known, node 0 accepted: both first tokens are decided, their children not yet.
    assert observed(parents, depths, [0], known=1, done=0).tolist() == [True, True, False, False]
    # A second token later: node 2 (child of accepted 0) is decided; node 3's parent was wrong.
    assert observed(parents, depths, [0, 2], known=2, done=1).tolist() == [False, False, True, False]


def test_best_subtree_follows_a_curve_where_three_tokens_cost_more_than_five() -> None:
    curve = CostCurve((1, 2, 3, 4, 5), (1.0, 1.6, 1.9, 1.4, 1.3))
    t = _tree([5, 6, 7, 8], [-1, 0, 1, 2], [0.9, 0.1, 0.1, 0.1])
    # One node: 1.9 / 1.6; two: 2.0 / 1.9; all four: 2.2 / 1.3 -- padding the block pays.
    assert len(best_subtree(t, curve, np.array([0.9, 0.1, 0.1, 0.1]))) == 4


def test_calibrated_drafter_learns_from_unverified_nodes() -> None:
    steep = CostCurve((1, 2, 3), (1.0, 1.5, 2.0))
    model = AcceptanceModel(SMALL)
    chain = _tiered([7, 8], [-1, 0], [0.9, 0.9], [1, 1])
    drafter = CalibratedDrafter(lambda ctx: chain, steep, model)
    # Cold: 0.375 per node is not worth 1.5x the cost of a step, so nothing is verified ...
    assert len(drafter(np.array([1, 2], np.int32))) == 0
    # ... yet the target's next tokens (7, 8, 7, 8, ...) reveal that every chain was right.
    for i in range(1, 12):
        drafter(np.array([1, 2] + [7, 8] * i, np.int32))
    assert model.hits[1, 0, 1] == model.trials[1, 0, 1] > 0  # depth 1, all right
    assert model.hits[1, 1, 1] == model.trials[1, 1, 1] > 0  # depth 2, all right
    assert drafter(np.array([1, 2] + [7, 8] * 12, np.int32)).tokens.tolist() == [7, 8]  # now worth verifying


def test_cost_aware_keeps_raw_scores_without_a_model() -> None:
    t = _tree([5, 6], [-1, 0], [0.9, 0.8])
    assert len(cost_aware(lambda ctx: t, STEEP)(np.array([1], np.int32))) == 0
    assert isinstance(cost_aware(lambda ctx: t, STEEP, AcceptanceModel(CalibrationConfig())), CalibratedDrafter)


def test_bad_calibration_configs_are_rejected() -> None:
    for kwargs in (
        {"score_edges": (0.5, 0.2)},
        {"score_edges": (0.0, 0.5)},
        {"depth_edges": (1,)},
        {"prior_strength": 0.0},
        {"prior_scale": 1.5},
    ):
        with pytest.raises(ValueError):
            CalibrationConfig(**kwargs)  # type: ignore[arg-type]

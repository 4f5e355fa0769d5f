"""Cost-aware verification: trees cut to their most profitable prefix."""

from __future__ import annotations

import numpy as np
import pytest

from decoder_client.cost_model import CostCurve, best_subtree, cost_aware
from decoder_client.reference_decoder import ReferenceDecoder
from indexer.tree_builder import DraftTree


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
        reference = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[
            0, len(prompt) :
        ].tolist()

    def guess(context: np.ndarray) -> DraftTree:  # a fixed wrong-ish chain: pruning must not change output
        return _tree([1, 2, 3], [-1, 0, 1], [0.9, 0.8, 0.7])

    tokens, _ = ReferenceDecoder(model).generate(prompt, 12, drafter=cost_aware(guess, curve))
    assert tokens == reference

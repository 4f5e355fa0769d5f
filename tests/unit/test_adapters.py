"""Tree -> chain conversion for chain-only servers."""

from __future__ import annotations

import numpy as np
import pytest

from decoder_client.adapters import ChainProposer, best_chain
from indexer.tree_builder import DraftTree


def _tree(tokens: list[int], parents: list[int], scores: list[float]) -> DraftTree:
    n = len(tokens)
    return DraftTree(
        np.array(tokens, np.int32), np.array(parents, np.int32), np.zeros(n, np.uint8), np.array(scores, np.float32)
    )


def test_chain_follows_the_best_child_at_every_level() -> None:
    t = _tree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 3], [0.5, 0.7, 0.2, 0.1, 0.05])
    # The root's best child is 2 (0.7 > 0.5); 2 has no children: the chain stops there.
    assert best_chain(t, 8).tolist() == [2]


def test_chain_is_cut_at_max_len() -> None:
    t = _tree([7, 8, 9], [-1, 0, 1], [0.9, 0.8, 0.7])
    # A chain tree stays a chain, cut to the first two tokens.
    assert best_chain(t, 2).tolist() == [7, 8]


def test_ties_go_to_the_earlier_node() -> None:
    t = _tree([4, 5], [-1, -1], [0.5, 0.5])
    # Equal scores: the first node in wire order wins, so the result is deterministic.
    assert best_chain(t, 4).tolist() == [4]


def test_empty_tree_gives_an_empty_chain() -> None:
    assert best_chain(DraftTree.empty(), 4).size == 0


def test_proposer_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ChainProposer(client=None, num_speculative_tokens=0)  # type: ignore[arg-type]
    proposer = ChainProposer(client=None, num_speculative_tokens=3)  # type: ignore[arg-type]
    # A request never started cannot be proposed for.
    with pytest.raises(ValueError, match="unknown requests"):
        proposer.propose({"nope": [1]})

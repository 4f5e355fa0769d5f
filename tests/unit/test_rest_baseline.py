"""REST's retriever as a replay baseline: the trie of its paths, and how it is driven."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from decoder_client.baselines import RestDrafter, tree_of_paths
from indexer.tree_builder import Tier

draftretriever = pytest.importorskip("draftretriever")


def test_tree_of_paths_is_a_trie_with_parents_first() -> None:
    tree = tree_of_paths([[5, 6, -2], [5, 7, 8], [9, -2, -2], [5, 6, 4]])
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 2, -1, 1]
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))
    assert set(tree.sources.tolist()) == {Tier.PRIOR}


def test_tree_of_paths_of_nothing_is_empty() -> None:
    assert len(tree_of_paths([])) == 0
    assert len(tree_of_paths([[-2, -2]])) == 0


STORY = [101, 102, 103, 104, 105, 106, 107, 108]


@pytest.fixture
def datastore(tmp_path: Path) -> str:
    path = tmp_path / "rest.idx"
    writer = draftretriever.Writer(file_path=str(path), vocab_size=1000)
    for _ in range(3):
        writer.add_entry(STORY)
    writer.add_entry([200, 201, 202, 203])
    writer.finalize()
    del writer
    return str(path)


def test_drafts_what_followed_the_context_in_the_corpus(datastore: str) -> None:
    rest = RestDrafter(datastore, choices=16)
    rest.start(np.array([7, 7, 101, 102], dtype=np.int32))  # the corpus never saw 7 7 101 102
    tree = rest.propose()
    assert len(tree) > 0 and tree.tokens[0] == 103  # found by a shorter span: 101 102
    assert len(tree.accept(np.array(STORY[2:], dtype=np.int32))) >= 2
    rest.advance(np.array([103, 104], dtype=np.int32))
    assert rest.propose().tokens[0] == 105
    rest.finish(0)


def test_an_unknown_or_too_short_context_drafts_nothing(datastore: str) -> None:
    rest = RestDrafter(datastore)
    rest.start(np.array([101], dtype=np.int32))  # one token: below REST's shortest span
    assert len(rest.propose()) == 0
    rest.start(np.array([900, 901, 902], dtype=np.int32))
    assert len(rest.propose()) == 0


def test_tree_size_stays_within_choices(datastore: str) -> None:
    rest = RestDrafter(datastore, choices=2)
    rest.start(np.array([101, 102], dtype=np.int32))
    assert 0 < len(rest.propose()) <= 2


@pytest.mark.parametrize("kwargs", [{"min_span": 1}, {"max_span": 1, "min_span": 2}, {"choices": 0}])
def test_bad_settings_are_refused(datastore: str, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RestDrafter(datastore, **kwargs)

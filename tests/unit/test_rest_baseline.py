"""REST's retriever as a replay baseline: the trie of its paths, and how it is driven."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.baselines import RestDrafter, _ChildReader, tree_of_paths
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


@pytest.fixture(scope="module")
def datastore(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("rest") / "rest.idx"
    writer = draftretriever.Writer(file_path=str(path), vocab_size=1000)
    for _ in range(3):
        writer.add_entry(STORY)
    writer.add_entry([200, 201, 202, 203])
    writer.finalize()
    del writer
    return str(path)


@pytest.fixture
def rest(datastore: str) -> Iterator[Callable[..., RestDrafter]]:
    made: list[RestDrafter] = []

    def make(**kwargs: int) -> RestDrafter:
        made.append(RestDrafter(datastore, **kwargs))
        return made[-1]

    yield make
    for drafter in made:
        drafter.close()


def test_drafts_what_followed_the_context_in_the_corpus(rest: Callable[..., RestDrafter]) -> None:
    drafter = rest(choices=16)
    drafter.start(np.array([7, 7, 101, 102], dtype=np.int32))  # the corpus never saw 7 7 101 102
    tree = drafter.propose()
    assert len(tree) > 0 and tree.tokens[0] == 103  # found by a shorter span: 101 102
    assert len(tree.accept(np.array(STORY[2:], dtype=np.int32))) >= 2
    drafter.advance(np.array([103, 104], dtype=np.int32))
    assert drafter.propose().tokens[0] == 105
    drafter.finish(0)


def test_an_unknown_or_too_short_context_drafts_nothing(rest: Callable[..., RestDrafter]) -> None:
    drafter = rest()
    drafter.start(np.array([101], dtype=np.int32))  # one token: below REST's shortest span
    assert len(drafter.propose()) == 0
    drafter.start(np.array([900, 901, 902], dtype=np.int32))
    assert len(drafter.propose()) == 0


def test_tree_size_stays_within_choices(rest: Callable[..., RestDrafter]) -> None:
    drafter = rest(choices=2)
    drafter.start(np.array([101, 102], dtype=np.int32))
    assert 0 < len(drafter.propose()) <= 2


def test_the_retriever_process_is_replaced_between_requests(rest: Callable[..., RestDrafter]) -> None:
    drafter = rest(recycle=3)
    first = drafter._reader._proc.pid
    for _ in range(2):  # a request of 4 searches, then the next one starts in a new process
        drafter.start(np.array([101, 102], dtype=np.int32))
        for _ in range(4):
            assert drafter.propose().tokens[0] == 103
    assert drafter._reader._proc.pid != first and drafter._reader.searches == 4


def test_a_retriever_that_dies_is_replaced(datastore: str) -> None:
    reader = _ChildReader(datastore)
    try:
        first = reader._proc.pid
        with pytest.raises(RuntimeError, match="died"):
            reader.search([101], 8)  # the library aborts its process on a 1-token query
        assert reader._proc.pid != first
        assert reader.search([101, 102], 8)[0][0] == 103
    finally:
        reader.close()


def test_a_missing_or_corrupt_datastore_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"nothing\.idx"):
        RestDrafter(str(tmp_path / "nothing.idx"))
    junk = tmp_path / "junk.idx"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    with pytest.raises(OSError, match="not a draftretriever datastore"):
        RestDrafter(str(junk))


@pytest.mark.parametrize("kwargs", [{"min_span": 1}, {"max_span": 1, "min_span": 2}, {"choices": 0}, {"recycle": 0}])
def test_bad_settings_are_refused(datastore: str, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RestDrafter(datastore, **kwargs)


def test_replayed_mat_by_hand(rest: Callable[..., RestDrafter]) -> None:
    # The prompt ends with 101 102: REST drafts 103 104 105 106 (its retriever's paths are at
    # most 4 deep), all accepted with the bonus 107; then 106 107 finds 108, accepted with the
    # bonus 999. Seven tokens in two steps, and as many again: the datastore learns nothing.
    from benchmarks.replay import replay
    from benchmarks.traces import Conversation, Segment

    segments = (
        Segment("input", np.array([7, 101, 102], np.int32)),
        Segment("output", np.array([*STORY[2:], 999], np.int32)),
    )
    conv = Conversation("c", "ns", "c", segments)
    drafter = rest(choices=16)
    for _ in range(2):
        stats = replay([conv], drafter)
        assert (stats.tokens, stats.steps) == (7, 2)

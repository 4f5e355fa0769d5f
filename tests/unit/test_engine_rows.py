"""RowTracker: requests followed across an engine's steps from its token rows alone."""

from __future__ import annotations

import numpy as np
import pytest

from decoder_client.engines.rows import RowTracker, Track


def rows(*contents: list[int], width: int = 8) -> tuple[np.ndarray, list[int]]:
    """A token matrix (zero-padded, as an engine's is) and the rows' lengths."""
    matrix = np.zeros((len(contents), width), dtype=np.int32)
    for i, c in enumerate(contents):
        matrix[i, : len(c)] = c
    return matrix, [len(c) for c in contents]


def test_new_rows_start_tracks_with_their_whole_row() -> None:
    tracker = RowTracker()
    step = tracker.step(*rows([1, 2, 3], [4, 5]), produced={0: 1, 1: 1})
    assert {i: t.tokens.tolist() for i, t in step.started.items()} == {0: [1, 2, 3], 1: [4, 5]}
    assert step.continued == {} and step.left == []


def test_a_row_continues_its_request_with_only_the_new_tokens() -> None:
    tracker = RowTracker()
    first = tracker.step(*rows([1, 2, 3]), produced={0: 1}).started[0]
    step = tracker.step(*rows([1, 2, 3, 9, 8]), produced={0: 2})  # a draft token accepted, and the bonus
    track, new = step.continued[0]
    assert track is first and new.tolist() == [9, 8] and step.moved == 0
    assert track.tokens.tolist() == [1, 2, 3, 9, 8]


def test_condensed_batch_rows_keep_their_requests() -> None:
    tracker = RowTracker()
    start = tracker.step(*rows([1, 1], [2, 2], [3, 3]), produced={0: 1, 1: 1, 2: 1})
    a, c = start.started[0], start.started[2]
    # Row 0's request finished; the engine moved its last row (request c) into the hole.
    step = tracker.step(*rows([3, 3, 7], [2, 2, 6]), produced={0: 1, 1: 1})
    assert step.continued[0][0] is c and step.continued[0][1].tolist() == [7]
    assert step.continued[1][1].tolist() == [6]
    assert step.left == [a]  # closed by the caller, with commit
    assert step.moved == 1


def test_identical_histories_are_served_by_either_track_and_keep_their_rows() -> None:
    tracker = RowTracker()
    start = tracker.step(*rows([5, 6], [5, 6]), produced={0: 1, 1: 1})
    t0, t1 = start.started[0], start.started[1]
    step = tracker.step(*rows([5, 6, 7], [5, 6, 7]), produced={0: 1, 1: 1})
    assert step.continued[0][0] is t0 and step.continued[1][0] is t1  # each row keeps its own
    # They diverge (sampling): each track still holds exactly its own row's history.
    step = tracker.step(*rows([5, 6, 7, 1], [5, 6, 7, 2]), produced={0: 1, 1: 1})
    assert t0.tokens.tolist() == [5, 6, 7, 1] and t1.tokens.tolist() == [5, 6, 7, 2]


def test_a_row_that_is_no_longer_its_request_starts_a_new_track() -> None:
    tracker = RowTracker()
    old = tracker.step(*rows([1, 2, 3]), produced={0: 1}).started[0]
    step = tracker.step(*rows([1, 2, 4, 5]), produced={0: 1})  # same place, another history
    assert step.left == [old] and step.started[0].tokens.tolist() == [1, 2, 4, 5]


def test_steps_the_tracker_did_not_see_are_caught_up() -> None:
    tracker = RowTracker()
    tracker.step(*rows([1, 2]), produced={0: 1})
    step = tracker.step(*rows([1, 2, 3, 4, 5, 6]), produced={0: 1})  # steps the engine did not call us for
    assert step.continued[0][1].tolist() == [3, 4, 5, 6]


def test_rows_not_live_are_ignored_and_their_old_requests_leave() -> None:
    tracker = RowTracker()
    old = tracker.step(*rows([1, 2], [3, 4]), produced={0: 1, 1: 1}).started[1]
    step = tracker.step(*rows([1, 2, 9], [8, 8, 8]), produced={0: 1})  # row 1 now prefills another prompt
    assert step.left == [old] and list(step.continued) == [0] and step.started == {}
    assert [t.tokens.tolist() for t in tracker.tracks] == [[1, 2, 9]]


def test_a_moved_row_goes_to_the_longest_history_not_to_a_shorter_one_in_its_place() -> None:
    tracker = RowTracker()
    # Identical prompts: request b is ahead of request a, whose history begins b's row.
    start = tracker.step(*rows([1, 2], [1, 2, 3, 4]), produced={0: 1, 1: 1})
    a, b = start.started[0], start.started[1]
    # a finished; the engine moved b into row 0 and b produced 5.
    step = tracker.step(*rows([1, 2, 3, 4, 5]), produced={0: 1})
    assert step.continued[0][0] is b and step.continued[0][1].tolist() == [5]
    assert step.left == [a] and step.moved == 1


def test_clear_returns_the_live_tracks() -> None:
    tracker = RowTracker()
    tracker.step(*rows([1], [2]), produced={0: 1, 1: 1})
    assert sorted(t.tokens.tolist()[0] for t in tracker.clear()) == [1, 2]
    assert tracker.tracks == []
    assert tracker.step(*rows([1, 5]), produced={0: 1}).started[0].tokens.tolist() == [1, 5]  # a new session


@pytest.mark.parametrize("length", [1, 3, 40])
def test_track_buffer_grows_in_place(length: int) -> None:
    track = Track(np.arange(length, dtype=np.int32))
    row = np.arange(length + 100, dtype=np.int32)
    assert track.prefix_of(row)
    assert track.grow_to(row).tolist() == list(range(length, length + 100))
    assert track.tokens.tolist() == row.tolist()
    assert not track.prefix_of(row[:-1])  # longer than the row: not its prefix

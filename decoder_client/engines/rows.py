"""Which request each row of an engine's batch is, told from the rows' tokens alone.

An engine that hands its proposer only token rows (vLLM's custom proposers get the batch's token
matrix and per-row lengths, with no request ids) still shows everything needed: a row is a
request's whole history so far, and a request only ever grows. So a tracked request continues
in the row whose tokens start with everything it held at the previous step; a row that no
tracked request is a prefix of is a request new to the tracker (admitted, or resumed after
preemption); a tracked request that no row continues has left the batch (finished, preempted,
or not scheduled this step).

By construction a track's tokens are always exactly a prefix of the row it is matched to, so
what is drafted for a row is drafted for that row's own context, whatever the engine did to
its batch (rows moved when it condensed, steps the proposer did not see). A row keeps its track
when that track is exactly this step's tokens behind it (the usual step); otherwise the longest
history that begins the row continues in it, since a shorter one may be another request with
the same start. Two rows with the same history (identical prompts decoded greedily) are
interchangeable: either track serves either row.

>>> rows = np.array([[7, 8, 9, 0], [5, 6, 0, 0]], dtype=np.int32)
>>> tracker = RowTracker()
>>> step = tracker.step(rows, [3, 2], produced={0: 1, 1: 1})
>>> sorted(step.started), step.left
([0, 1], [])
>>> rows[[0, 1]] = rows[[1, 0]]  # the engine swapped the two rows
>>> rows[0, 2], rows[1, 3] = 4, 1  # and each request produced a token
>>> step = tracker.step(rows, [3, 4], produced={0: 1, 1: 1})
>>> {row: new.tolist() for row, (_, new) in step.continued.items()}, step.moved
({0: [4], 1: [1]}, 2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


class Track:
    """One request as its rows showed it: its tokens so far, in a buffer that grows in place."""

    __slots__ = ("_buf", "length", "payload")

    def __init__(self, tokens: np.ndarray) -> None:
        self._buf = np.array(tokens, dtype=np.int32)
        self.length = len(tokens)
        self.payload: object = None  # what the caller keeps per request (its draft session)

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self.length]

    def prefix_of(self, row: np.ndarray) -> bool:
        """Whether this request's tokens begin ``row``."""
        return self.length <= len(row) and np.array_equal(row[: self.length], self.tokens)

    def grow_to(self, row: np.ndarray) -> np.ndarray:
        """Take ``row`` (which this track is a prefix of) as the request's tokens now; the
        tokens it gained, as a new array."""
        new = np.array(row[self.length :], dtype=np.int32)
        if len(row) > len(self._buf):
            bigger = np.empty(max(len(row), 2 * len(self._buf)), dtype=np.int32)
            bigger[: self.length] = self.tokens
            self._buf = bigger
        self._buf[self.length : len(row)] = new
        self.length = len(row)
        return new


@dataclass
class Step:
    """One step's matching: rows that continue a track (with the tokens the track gained), rows
    that start a track (their whole row is its history), tracks no row continues."""

    continued: dict[int, tuple[Track, np.ndarray]] = field(default_factory=dict)
    started: dict[int, Track] = field(default_factory=dict)
    left: list[Track] = field(default_factory=list)
    moved: int = 0  # continued rows whose request was in another row at the previous step

    def track(self, row: int) -> Track:
        return self.started[row] if row in self.started else self.continued[row][0]


class RowTracker:
    """Tracks requests across an engine's steps from its token rows; see the module docstring."""

    def __init__(self) -> None:
        self._by_row: dict[int, Track] = {}

    @property
    def tracks(self) -> list[Track]:
        return list(self._by_row.values())

    def step(self, token_rows: np.ndarray, lengths: Sequence[int] | np.ndarray, produced: Mapping[int, int]) -> Step:
        """Match the live rows (``produced``: row -> tokens it gained this step; each row is
        ``lengths[row]`` tokens of ``token_rows``) to the tracks of the previous step. Rows not
        listed are ignored (a prompt still being prefilled); a track matched to none has left."""
        rows = {i: token_rows[i, : int(lengths[i])] for i in produced}
        out = Step()
        pool = dict(self._by_row)
        for i, row in rows.items():  # most rows: the request they held, exactly one step behind
            track = pool.get(i)
            if track is not None and track.length == len(row) - produced[i] and track.prefix_of(row):
                del pool[i]
                out.continued[i] = (track, track.grow_to(row))
        for i, row in rows.items():  # rows the engine moved, caught up or filled anew
            if i in out.continued:
                continue
            # The longest history that begins the row: a shorter one may be another request with
            # the same start (identical prompts), or this row's previous request, gone.
            fits = [(t.length, key == i, key) for key, t in pool.items() if t.prefix_of(row)]
            if fits:
                track = pool.pop(max(fits)[2])
                out.continued[i] = (track, track.grow_to(row))
                out.moved += self._by_row.get(i) is not track
            else:
                out.started[i] = Track(row)
        out.left = list(pool.values())
        self._by_row = {i: out.track(i) for i in rows}
        return out

    def clear(self) -> list[Track]:
        """Forget every track (the engine went idle): those that were live."""
        tracks, self._by_row = self.tracks, {}
        return tracks

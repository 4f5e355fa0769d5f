"""Traces that record the target's top-k per output token, and replay handing those rows to the
drafter exactly at the positions a decoder verified."""

import gzip
import json

import numpy as np
import pytest

from benchmarks.baselines import EngineDrafter, PromptLookupDrafter
from benchmarks.replay import replay, takes_topk
from benchmarks.replay_bench import BestChain, by_namespace
from benchmarks.traces import Conversation, Segment, read_traces, write_traces
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _rows(tokens):
    """Top-3 rows whose every id says where it came from: [token i, 100 + i, 200 + i]."""
    return _a([[t, 100 + i, 200 + i] for i, t in enumerate(tokens)])


def _conv(cid, *segments):
    """Segments as (kind, tokens); outputs get :func:`_rows` as their top-k."""
    return Conversation(
        cid,
        "ns",
        "all",
        tuple(Segment(k, _a(t), _rows(t) if k == "output" else None) for k, t in segments),
    )


# Prompt lookup on [1 2 3 4 1 2] drafts "3 4 1 2"; the target says 3 4 7 8.
PARTIAL = _conv("partial", ("input", [1, 2, 3, 4, 1, 2]), ("output", [3, 4, 7, 8]))


class _Recording:
    """Prompt lookup that records every ``advance`` call it gets."""

    name = "recording"

    def __init__(self):
        self.inner = PromptLookupDrafter()
        self.calls = []

    def start(self, prompt):
        self.inner.start(prompt)

    def propose(self):
        return self.inner.propose()

    def advance(self, tokens, topk=None):
        self.calls.append((tokens.tolist(), None if topk is None else topk.tolist()))
        self.inner.advance(tokens)

    def finish(self, commit_from):
        self.inner.finish(commit_from)


class _TokensOnly(_Recording):
    """The same, with the ``advance`` of a drafter that takes no top-k."""

    def advance(self, tokens):
        self.calls.append((tokens.tolist(), "no topk parameter"))
        self.inner.advance(tokens)


def test_rows_handed_over_are_the_verified_positions():
    rec = _Recording()
    stats = replay([PARTIAL], rec)
    assert rec.calls == [
        # Step 1: "3 4" accepted, bonus 7. The target was read after the context's last token
        # (row 0: it predicted 3) and after each accepted draft token (rows 1, 2).
        ([3, 4, 7], [[3, 100, 200], [4, 101, 201], [7, 102, 202]]),
        # Step 2: empty draft, bonus 8: only the position after 7 was verified (row 3).
        ([8], [[8, 103, 203]]),
    ]
    # Every output position was verified once: four rows handed over for four tokens.
    assert stats.topk_rows == 4 and stats.summary()["topk_rows"] == 4
    assert (stats.steps, stats.tokens) == (2, 4)  # the top-k changes nothing about MAT


def test_rows_restart_with_each_output_segment():
    conv = _conv("mt", ("input", [1, 2, 3]), ("output", [9]), ("input", [1, 2]), ("output", [3, 9]))
    rec = _Recording()
    replay([conv], rec)
    assert rec.calls == [
        ([9], [[9, 100, 200]]),  # turn 1: one step, its one row
        # Turn 2: "1 2" drafts "3 9", both accepted; the bonus is past the output's end, so the
        # step yields the 2 tokens and rows 0, 1 of this segment (not of the first one).
        ([3, 9], [[3, 100, 200], [9, 101, 201]]),
    ]


def test_no_topk_when_switched_off_or_not_recorded_or_not_taken():
    off = _Recording()
    replay([PARTIAL], off, topk=False)
    # Switched off: the same steps, no rows.
    assert off.calls == [([3, 4, 7], None), ([8], None)]
    plain = Conversation("p", "ns", "all", tuple(Segment(s.kind, s.tokens) for s in PARTIAL.segments))
    rec = _Recording()
    stats = replay([plain], rec)
    # A trace without top-k: nothing handed over, and no top-k line in the summary.
    assert rec.calls == [([3, 4, 7], None), ([8], None)]
    assert stats.topk_rows == 0 and "topk_rows" not in stats.summary()
    old = _TokensOnly()
    # A drafter whose advance takes no top-k is called as before.
    assert not takes_topk(old) and takes_topk(rec)
    assert replay([PARTIAL], old).topk_rows == 0
    assert old.calls == [([3, 4, 7], "no topk parameter"), ([8], "no topk parameter")]
    # Nor does a chain cut of it pass rows on.
    wrapped = _TokensOnly()
    replay([PARTIAL], BestChain(wrapped, 1))
    assert {rows for _, rows in wrapped.calls} == {"no topk parameter"}


def test_best_chain_forwards_the_rows_and_the_engine_takes_them():
    rec = _Recording()
    stats = replay([PARTIAL], BestChain(rec, 1))
    # Cut to 1 token: "3" accepted + bonus 4, then "1" rejected + bonus 7, then nothing + 8.
    assert rec.calls == [
        ([3, 4], [[3, 100, 200], [4, 101, 201]]),
        ([7], [[7, 102, 202]]),
        ([8], [[8, 103, 203]]),
    ]
    assert stats.topk_rows == 4
    engine = NamespaceDrafter(Namespace(name="ns", vocab_size=300), DrafterConfig())
    ours = EngineDrafter(engine, DraftParams())
    # The in-process engine takes the rows: every verified position's, once.
    assert takes_topk(ours)
    with_rows = replay([PARTIAL, PARTIAL], ours)
    assert with_rows.topk_rows == with_rows.tokens == 8


# -- the trace format --------------------------------------------------------------------------


def _write_gz(path, objs):
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(o) for o in objs) + "\n")


def _obj(output_topk, input_extra=None):
    return {
        "id": "q",
        "namespace": "ns",
        "segments": [
            {"kind": "input", "tokens": [1, 2], **(input_extra or {})},
            {"kind": "output", "tokens": [5, 6], "topk": output_topk},
        ],
    }


def test_topk_round_trips_and_plain_traces_read_as_before(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    write_traces([PARTIAL], path)
    (back,) = read_traces(path)
    out = back.segments[1]
    # The rows come back as an int32 (tokens, k) array; inputs carry none.
    assert out.topk is not None and out.topk.dtype == np.int32
    assert out.topk.tolist() == _rows([3, 4, 7, 8]).tolist()
    assert back.segments[0].topk is None and back.has_topk
    # The largest id counts the top-k ids too (203 in row 3).
    assert back.largest_id() == 203
    _write_gz(path, [{"id": "p", "namespace": "ns", "segments": [{"kind": "output", "tokens": [5]}]}])
    (plain,) = read_traces(path)
    assert plain.segments[0].topk is None and not plain.has_topk


@pytest.mark.parametrize(
    "obj",
    [
        _obj([[5, 1]]),  # one row for two tokens
        _obj([[5, 1], [6]]),  # ragged rows
        _obj([[5, 1], [6, 6]]),  # an id repeated in a row
        _obj([[5, *range(10, 18)], [6, *range(10, 18)]]),  # 9 ids a row, more than 8
        _obj([[5, -1], [6, 1]]),  # a negative id
        _obj([[], []]),  # empty rows
        _obj("5 6"),  # not a list of rows
        _obj([[5, 1], [6, 1]], {"topk": [[1], [2]]}),  # top-k on an input segment
    ],
)
def test_malformed_topk_names_the_line(tmp_path, obj):
    path = tmp_path / "bad.jsonl.gz"
    _write_gz(path, [_obj([[5, 1], [6, 1]]), obj])
    # The first line is fine; the second is refused, by line number.
    with pytest.raises(ValueError, match=r":2: malformed"):
        read_traces(path)


def test_topk_ids_must_lie_in_the_namespace_vocabulary():
    # Tokens fit in 10 ids, but the top-k names id 203: a vocabulary of 10 is refused.
    with pytest.raises(ValueError, match="partial: id 203 is outside the vocabulary"):
        by_namespace([PARTIAL], 10)
    # Guessed from the trace, the vocabulary covers the top-k ids too.
    ((ns, _),) = by_namespace([PARTIAL])
    assert ns.vocab_size == 204


def test_empty_trees_still_advance_with_rows():
    class Empty(_Recording):
        def propose(self):
            return DraftTree.empty()

    rec = Empty()
    replay([PARTIAL], rec)
    # Nothing drafted: each step verifies one position and hands over its one row.
    assert [rows for _, rows in rec.calls] == [[[t, 100 + i, 200 + i]] for i, t in enumerate([3, 4, 7, 8])]

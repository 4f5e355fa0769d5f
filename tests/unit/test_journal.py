"""The commit journal's file: records survive a reopen, a torn tail or a damaged record is
skipped (and said), a full journal refuses, a drained one empties."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from cache_service.host.journal import HEADER, Journal, JournalError, JournalRecord, encode
from tests.faults import can_mount_tmpfs, fill_disk, small_disk

WRITER = b"w" * 16


def _record(seq: int, ns: str = "ns", tokens: tuple[int, ...] = (5, 6, 7)) -> JournalRecord:
    return JournalRecord(WRITER, seq, ns, np.array(tokens, dtype=np.int32))


def _seen(records: list[JournalRecord]) -> list[tuple[int, str, list[int]]]:
    return [(r.seq, r.namespace, r.tokens.tolist()) for r in records]


def _reopen(path: Path, capacity: int = 1 << 20) -> tuple[Journal, list[JournalRecord]]:
    journal = Journal(path, capacity)
    return journal, journal.open()


def test_records_survive_a_reopen_in_order(tmp_path: Path) -> None:
    journal, found = _reopen(tmp_path / "j")
    assert found == []
    journal.append([_record(0), _record(1, "acme/llama", (1,))])
    journal.append([_record(2, tokens=())])  # an empty request is a record too
    journal.close()
    _, found = _reopen(tmp_path / "j")
    assert _seen(found) == [(0, "ns", [5, 6, 7]), (1, "acme/llama", [1]), (2, "ns", [])]
    assert all(r.tokens.dtype == np.int32 and r.writer == WRITER for r in found)


def test_a_torn_tail_is_skipped_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "j"
    whole = encode(_record(0)) + encode(_record(1))
    path.write_bytes(whole + encode(_record(2))[:-3])  # the process died mid-write
    with caplog.at_level(logging.WARNING):
        journal, found = _reopen(path)
    assert _seen(found) == [(0, "ns", [5, 6, 7]), (1, "ns", [5, 6, 7])]
    assert "torn record" in caplog.text
    assert path.read_bytes() == whole  # rewritten without it: the next append lands clean
    journal.append([_record(3)])
    journal.close()
    assert [r.seq for r in _reopen(path)[1]] == [0, 1, 3]


def test_a_damaged_record_is_skipped_and_the_rest_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "j"
    first, second, third = encode(_record(0)), bytearray(encode(_record(1))), encode(_record(2))
    second[HEADER.size + 20] ^= 0xFF  # a flipped bit in the payload: the checksum fails
    path.write_bytes(first + bytes(second) + third)
    with caplog.at_level(logging.WARNING):
        _, found = _reopen(path)
    assert [r.seq for r in found] == [0, 2]  # reading resumed at the next record's magic
    assert "fails its checksum" in caplog.text


def test_a_full_journal_refuses_and_writes_nothing(tmp_path: Path) -> None:
    one = len(encode(_record(0)))
    journal, _ = _reopen(tmp_path / "j", capacity=2 * one)
    journal.append([_record(0), _record(1)])
    with pytest.raises(JournalError, match="journal full") as refused:
        journal.append([_record(2)])
    assert not refused.value.disk_full
    assert journal.size_bytes == 2 * one == (tmp_path / "j").stat().st_size


def test_drained_empties_or_compacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal, _ = _reopen(tmp_path / "j")
    records = [_record(i) for i in range(10)]
    journal.append(records)
    journal.drained(records[8:])  # most of the file is in storage: kept as it is below 1 MiB
    assert journal.size_bytes == 10 * len(encode(records[0]))
    monkeypatch.setattr("cache_service.host.journal.COMPACT_MIN_BYTES", 0)
    journal.drained(records[8:])  # now rewritten with the two still to store
    assert _seen(read := _reopen_copy(tmp_path / "j")) == _seen(records[8:]) and len(read) == 2
    journal.append([_record(10)])  # the journal goes on in the new file
    journal.drained([])
    assert journal.size_bytes == 0 == (tmp_path / "j").stat().st_size


def _reopen_copy(path: Path) -> list[JournalRecord]:
    """What a new process would find (read from a copy: the journal is locked by its owner)."""
    copy = path.with_name("copy")
    copy.write_bytes(path.read_bytes())
    return _reopen(copy)[1]


def test_one_process_per_journal(tmp_path: Path) -> None:
    _reopen(tmp_path / "j")
    with pytest.raises(JournalError, match="in use"):
        _reopen(tmp_path / "j")


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs to mount a tmpfs (root)")
def test_a_rewrite_on_a_nearly_full_disk_keeps_every_live_record(tmp_path: Path) -> None:
    """A disk with less room than the rewritten file takes part of a write without an error:
    the compaction and the torn-tail repair must not put a partial file in the journal's place."""
    big = [JournalRecord(WRITER, i, "ns", np.arange(2500, dtype=np.int32) + i) for i in range(300)]  # ~10 kB each
    with small_disk(tmp_path / "disk", "4m") as disk:
        journal, _ = _reopen(disk / "j", capacity=1 << 30)
        journal.append(big)
        filler = fill_disk(disk)
        os.truncate(filler, filler.stat().st_size - 200_000)  # room for a fifth of the live records
        live = big[200:]
        journal.drained(live)  # two thirds dead: a compaction, which the disk cannot hold
        journal.close()
        journal, found = _reopen(disk / "j")
        journal.close()
        assert _seen(found) == _seen(big)  # the old file kept whole
        with open(disk / "j", "ab") as f:
            f.write(b"DCJ1" + b"\0" * 10)  # a torn tail: open() rewrites the file without it
        journal, found = _reopen(disk / "j")
        journal.close()
        assert _seen(found) == _seen(big)
        filler.unlink()
        journal, found = _reopen(disk / "j")  # what the next start finds
        journal.close()
        assert _seen(found) == _seen(big)

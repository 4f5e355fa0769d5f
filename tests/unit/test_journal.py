"""The commit journal's file: records survive a reopen, a torn tail or a damaged record is
skipped (and said), a full journal refuses, a drained one empties."""

from __future__ import annotations

import logging
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from cache_service.host.journal import (
    HEAD,
    HEADER,
    MAGIC_V1,
    MAGIC_V2,
    Journal,
    JournalError,
    JournalRecord,
    encode,
    journal_files,
    journal_path,
    record_size,
)
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


def test_one_process_per_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cache_service.host.journal.LOCK_WAIT_S", 0.2)
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


def test_journals_no_live_process_holds_are_taken_over(tmp_path: Path) -> None:
    """A journal of a stopped process (a worker of a run with more processes, or one process
    where there are workers now) is moved into the journal opened beside it; a live one is not."""
    root = tmp_path / "journal"
    left = [JournalRecord(b"a" * 16, i, "ns", np.array([i, i + 1], np.int32)) for i in range(3)]
    stopped, _ = _reopen(journal_path(root, 3))
    stopped.append(left)
    stopped.close()
    live, _ = _reopen(journal_path(root, 1))
    live.append([_record(9)])
    own = Journal(journal_path(root, None), capacity_bytes=len(encode(left[0])), root=root)  # room for one
    found = own.open()
    assert _seen(found) == _seen(left)  # beyond its capacity: they were acknowledged
    assert journal_path(root, 3).stat().st_size == 0  # emptied once they were in the new home
    assert journal_path(root, 1).stat().st_size == len(encode(_record(9)))  # its process lives
    own.close()
    assert _seen(_reopen_copy(journal_path(root, None))) == _seen(left)
    live.close()
    worker, found = _reopen_worker(root, 0)  # a worker now: the single process's journal and worker 1's
    assert sorted(_seen(found)) == sorted(_seen([*left, _record(9)]))
    assert [p.stat().st_size for p in journal_files(root) if p != worker.path] == [0, 0, 0]


def _reopen_worker(root: Path, index: int) -> tuple[Journal, list[JournalRecord]]:
    journal = Journal(journal_path(root, index), 1 << 20, root=root)
    return journal, journal.open()


def test_a_journal_taken_over_twice_is_harmless(tmp_path: Path) -> None:
    """A process that dies after moving a journal's records but before emptying it leaves them
    in two journals: both are read (the log's commit ids append each once)."""
    root = tmp_path / "journal"
    first, _ = _reopen(journal_path(root, 1))
    first.append([_record(1), _record(2)])
    first.close()
    copy = journal_path(root, 2)
    copy.parent.mkdir()
    copy.write_bytes(journal_path(root, 1).read_bytes())
    _, found = _reopen_worker(root, 0)
    assert _seen(found) == _seen([_record(1), _record(2)] * 2)


def test_records_of_the_first_format_are_still_read(tmp_path: Path) -> None:
    """A journal left by a build whose records named no log (magic DCJ1) replays after an
    upgrade: its records come back with the log not known ("", not checked)."""
    tokens = np.array([5, 6], np.int32)
    payload = HEAD.pack(WRITER, 3, 2) + b"ns" + tokens.astype("<i4").tobytes()
    old = HEADER.pack(MAGIC_V1, len(payload), zlib.crc32(payload)) + payload
    (tmp_path / "j").write_bytes(old + encode(JournalRecord(WRITER, 4, "ns", tokens, "f" * 32)))
    _, found = _reopen(tmp_path / "j")
    assert [(r.seq, r.namespace, r.tokens.tolist(), r.log) for r in found] == [
        (3, "ns", [5, 6], ""),
        (4, "ns", [5, 6], "f" * 32),
    ]


def test_records_of_the_second_format_are_still_read(tmp_path: Path) -> None:
    """A journal left by a build whose records named the log but no commit key (magic DCJ2)
    replays after an upgrade: its records come back without a key (never compared)."""
    tokens = np.array([5, 6], np.int32)
    payload = HEAD.pack(WRITER, 3, 2) + b"ns" + bytes([32]) + b"f" * 32 + tokens.astype("<i4").tobytes()
    old = HEADER.pack(MAGIC_V2, len(payload), zlib.crc32(payload)) + payload
    keyed = JournalRecord(WRITER, 4, "ns", tokens, "f" * 32, "k" * 32)
    (tmp_path / "j").write_bytes(old + encode(keyed) + old[:-3])  # and a torn copy of the old one
    _, found = _reopen(tmp_path / "j")
    assert [(r.seq, r.tokens.tolist(), r.log, r.key) for r in found] == [
        (3, [5, 6], "f" * 32, ""),
        (4, [5, 6], "f" * 32, "k" * 32),
    ]


def test_a_commit_key_survives_a_reopen_and_counts_in_the_size(tmp_path: Path) -> None:
    journal, _ = _reopen(tmp_path / "j")
    records = [JournalRecord(WRITER, i, "ns", np.arange(i, dtype=np.int32), "", "k" * (16 + i)) for i in range(3)]
    journal.append(records)
    journal.close()
    assert journal.size_bytes == sum(map(record_size, records)) == sum(len(encode(r)) for r in records)
    _, found = _reopen(tmp_path / "j")
    assert [(r.seq, r.key, r.tokens.tolist()) for r in found] == [(r.seq, r.key, r.tokens.tolist()) for r in records]

"""A local write-ahead journal of acknowledged commits not yet in Redis.

While storage cannot take a commit, the commit is appended here and fsynced before the close
call is answered; the service replays the journal into the lifetime log when storage returns
(and at start), and empties the file once every record is in Redis.

File format: a sequence of records, each ``MAGIC | length u32 | crc32 u32 | payload`` (little
endian), the CRC over the payload. Payload: ``writer`` (16 bytes, one random id per service
process), ``seq`` u64 (that writer's commit counter, increasing), the namespace's length u16
and UTF-8 name, the identity of the namespace's log the commit was made for (its length u8 and
ASCII text; empty when it was not known), the key the client named the commit with (its length
u8 and ASCII text; empty: none), then the request's int32 tokens. ``(writer, seq)`` is the
commit's id: the log append script records each writer's highest ``seq`` per namespace and
skips what it has seen, so a replay appends each commit once; it skips a commit whose key the
log recorded lately too (the client's retry of a commit that landed, journaled or not), and
refuses commits made for another log, one of a namespace deleted and created again meanwhile
(:mod:`cache_service.storage.stream_log`). Records of the earlier formats (magic ``DCJ1``: no
log identity; ``DCJ2``: no key) are still read.

A record torn by a crash mid-write, or damaged later, fails its CRC: it is skipped with a log
line, and reading resumes at the next record's magic.

A service run as one process journals to ``<root>/commits.journal``, worker ``i`` of a run with
``--processes`` to ``<root>/worker-<i>/commits.journal``. A journal no live process holds (its
process died, or the service came back with fewer or more processes) is taken over by the next
process that opens a journal under the same root: its records are appended to that process's
own journal, fsynced, and only then is the old file emptied. A crash in between leaves a record
in both, which the log's ``(writer, seq)`` check appends once.

>>> record = JournalRecord(b"w" * 16, 7, "llama2", np.array([5, 6], np.int32))
>>> [(r.seq, r.namespace, r.tokens.tolist()) for r in read_records(encode(record) + b"torn")[0]]
[(7, 'llama2', [5, 6])]
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"DCJ3"
MAGIC_V2 = b"DCJ2"  # records without the commit key
MAGIC_V1 = b"DCJ1"  # records without the log's identity (nor the key)
MAGICS = (MAGIC, MAGIC_V2, MAGIC_V1)
HEADER = struct.Struct("<4sII")  # magic, payload length, crc32 of the payload
HEAD = struct.Struct("<16sQH")  # writer, seq, namespace length
MAX_PAYLOAD = 1 << 30
NAME = "commits.journal"
LOCK_WAIT_S = 10.0  # how long opening waits for a process that is taking the file over
COMPACT_MIN_BYTES = 1 << 20  # dead bytes worth a rewrite of the live records


class JournalError(Exception):
    """A commit could not be journaled; ``disk_full``: the disk has no room left."""

    def __init__(self, message: str, *, disk_full: bool = False) -> None:
        super().__init__(message)
        self.disk_full = disk_full


@dataclass(frozen=True)
class JournalRecord:
    """One acknowledged commit: who wrote it, its number, its namespace and tokens."""

    writer: bytes
    seq: int
    namespace: str
    tokens: np.ndarray
    log: str = ""  # the identity of the namespace's log it was made for ("": not known)
    key: str = ""  # the key its client named it with, the same in every retry ("": none)

    @property
    def commit_id(self) -> str:
        return f"{self.writer.hex()}:{self.seq}"


def encode(record: JournalRecord) -> bytes:
    name = record.namespace.encode()
    tokens = np.ascontiguousarray(record.tokens, dtype="<i4").tobytes()
    payload = HEAD.pack(record.writer, record.seq, len(name)) + name + _short(record.log) + _short(record.key) + tokens
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _short(text: str) -> bytes:
    """An ASCII text of at most 255 characters, after its length."""
    raw = text.encode("ascii")
    return bytes([len(raw)]) + raw


def record_size(record: JournalRecord) -> int:
    """The bytes :func:`encode` makes of ``record``."""
    fixed = HEADER.size + HEAD.size + 2
    return fixed + len(record.namespace.encode()) + len(record.log) + len(record.key) + 4 * record.tokens.size


def _decode(payload: bytes, magic: bytes) -> JournalRecord:
    writer, seq, n = HEAD.unpack_from(payload)
    at = HEAD.size + n
    name = payload[HEAD.size : at].decode()
    texts = {MAGIC: 2, MAGIC_V2: 1, MAGIC_V1: 0}[magic]  # the log's identity, then the key
    found = ["", ""]
    for i in range(texts):
        size = payload[at]
        found[i], at = payload[at + 1 : at + 1 + size].decode("ascii"), at + 1 + size
    if (len(payload) - at) % 4:
        raise ValueError(f"{len(payload) - at} token bytes")
    tokens = np.frombuffer(payload, dtype="<i4", offset=at).astype(np.int32)
    return JournalRecord(writer, seq, name, tokens, *found)


def _next_magic(data: bytes, after: int) -> int:
    """Where the next record may start after byte ``after`` (-1: nowhere)."""
    found = [i for i in (data.find(m, after + 1) for m in MAGICS) if i >= 0]
    return min(found, default=-1)


def read_records(data: bytes) -> tuple[list[JournalRecord], list[str]]:
    """The intact records in ``data`` and a note for each stretch skipped (torn or corrupt)."""
    records: list[JournalRecord] = []
    skipped: list[str] = []
    at = 0
    while at < len(data):
        problem = None
        if len(data) - at < HEADER.size:
            problem = f"torn header at byte {at}"
        else:
            magic, size, crc = HEADER.unpack_from(data, at)
            end = at + HEADER.size + size
            payload = data[at + HEADER.size : end]
            if magic not in MAGICS or size > MAX_PAYLOAD or size < HEAD.size:
                problem = f"no record at byte {at}"
            elif end > len(data):
                problem = f"torn record at byte {at} ({len(data) - at} of {end - at} bytes)"
            elif zlib.crc32(payload) != crc:
                problem = f"record at byte {at} fails its checksum"
            else:
                try:
                    records.append(_decode(payload, magic))
                    at = end
                    continue
                except (struct.error, UnicodeDecodeError, ValueError, IndexError) as exc:
                    problem = f"record at byte {at} does not decode ({exc})"
        resume = _next_magic(data, at)
        skipped.append(f"{problem}: {(resume if resume >= 0 else len(data)) - at} bytes skipped")
        if resume < 0:
            break
        at = resume
    return records, skipped


def journal_path(root: Path, worker: int | None = None) -> Path:
    """Where a process journals: a single process directly under ``root``, worker ``i`` in a
    folder of its own.

    >>> journal_path(Path("data/journal")), journal_path(Path("data/journal"), 1)
    (PosixPath('data/journal/commits.journal'), PosixPath('data/journal/worker-1/commits.journal'))
    """
    return root / NAME if worker is None else root / f"worker-{worker}" / NAME


def journal_files(root: Path) -> list[Path]:
    """Every journal file under ``root``, whichever process layout wrote it."""
    return [p for p in (root / NAME, *sorted(root.glob(f"worker-*/{NAME}"))) if p.is_file()]


class Journal:
    """The journal file at ``path``, at most ``capacity_bytes`` long; ``root``: the folder whose
    other journals it takes over when no live process holds them (none: only its own).

    :meth:`open` locks it (one process per journal) and returns the records a previous run left;
    :meth:`append` makes records durable; :meth:`drained` tells it which records are still not
    in Redis, so it can empty or compact the file.
    """

    def __init__(self, path: Path, capacity_bytes: int, *, root: Path | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.root = root
        self._fd = -1
        self._size = 0

    @property
    def size_bytes(self) -> int:
        return self._size

    def open(self) -> list[JournalRecord]:
        """Lock the file and read what it holds, then take over the other journals under
        ``root`` that no live process holds; every record found. Torn or corrupt records are
        logged and left out (the file is rewritten with the intact ones)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if not _lock(self._fd, LOCK_WAIT_S):  # a process taking it over holds it a moment
            os.close(self._fd)
            self._fd = -1
            raise JournalError(f"{self.path} is in use by another process")
        _fsync_dir(self.path.parent)
        records, intact = self._read(self.path)
        self._size = self.path.stat().st_size
        if not intact:
            self._rewrite(records)
        if records:
            logger.info("commit journal %s holds %d commits not yet stored", self.path, len(records))
        if self.root is not None:
            for other in journal_files(self.root):
                if other.resolve() != self.path.resolve():
                    records += self._take_over(other)
        return records

    def _read(self, path: Path) -> tuple[list[JournalRecord], bool]:
        """The intact records in the file at ``path``, and whether nothing was skipped."""
        records, skipped = read_records(path.read_bytes())
        for note in skipped:
            logger.warning("commit journal %s: %s", path, note)
        return records, not skipped

    def _take_over(self, other: Path) -> list[JournalRecord]:
        """The records of the journal at ``other``, moved into this one, when no live process
        holds it (else nothing). They are appended beyond the capacity if need be: they were
        acknowledged, and they leave the other file."""
        try:
            fd = os.open(other, os.O_RDWR)
        except FileNotFoundError:
            return []
        try:
            if not _lock(fd, 0.0) or os.fstat(fd).st_ino != _inode(other):  # live, or replaced meanwhile
                return []
            records, _ = self._read(other)
            if records:
                try:
                    self.append(records, beyond_capacity=True)
                except JournalError as exc:  # they stay where they are, for a later start
                    logger.error("commit journal %s not taken over: %s", other, exc)
                    return []
                logger.warning("commit journal %s: %d commits of a stopped process taken over", other, len(records))
            if os.fstat(fd).st_size:
                os.ftruncate(fd, 0)
                os.fsync(fd)
            return records
        finally:
            os.close(fd)  # releases its lock

    def append(self, records: Sequence[JournalRecord], *, beyond_capacity: bool = False) -> None:
        """Write and fsync ``records``; :class:`JournalError` (nothing written) when the journal
        is full (unless ``beyond_capacity``) or the disk refuses."""
        data = b"".join(encode(r) for r in records)
        if not beyond_capacity and self._size + len(data) > self.capacity_bytes:
            raise JournalError(
                f"commit journal full ({self._size} of {self.capacity_bytes} bytes) while storage is unavailable"
            )
        try:
            _write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError as exc:
            self._truncate(self._size)  # no torn record before the next one
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise JournalError(f"commit journal write failed: {exc}", disk_full=full) from exc
        self._size += len(data)

    def drained(self, live: Sequence[JournalRecord]) -> None:
        """Records not in ``live`` are in Redis: empty the file when nothing is left, rewrite it
        when most of it is dead."""
        if not live:
            if self._size:
                self._truncate(0)
            return
        live_bytes = sum(record_size(r) for r in live)
        if self._size - live_bytes > max(live_bytes, COMPACT_MIN_BYTES):
            self._rewrite(live)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1

    def _truncate(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
            self._size = size
        except OSError as exc:  # the records stay; a replay skips what Redis has
            logger.warning("commit journal %s: could not truncate to %d bytes: %s", self.path, size, exc)

    def _rewrite(self, records: Sequence[JournalRecord]) -> None:
        """Replace the file with ``records`` (a new file renamed over the old one)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = b"".join(encode(r) for r in records)
        fd = -1
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked before it takes the name
            _write_all(fd, data)  # a nearly full disk takes part of a write without an error
            os.fsync(fd)
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
        except OSError as exc:
            logger.warning("commit journal %s: compaction failed, keeping the file: %s", self.path, exc)
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            return
        os.close(self._fd)
        self._fd = fd
        self._size = len(data)


def _lock(fd: int, wait_s: float) -> bool:
    """Take ``fd``'s exclusive lock, trying for up to ``wait_s``; whether it was taken."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return -1


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: ``write(2)`` may take part of it (a disk with less room left than
    ``data``) and say so only by its count; the next call then raises ``ENOSPC``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

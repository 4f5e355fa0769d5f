"""Generations of lifetime indexes as folders of ``.npy`` files, mapped read-only by every
server process of a host.

One folder per generation holds the indexed tokens, their suffix array, the n-gram table's
arrays and ``generation.json`` (the log it indexes and the position it covers up to). A small
pointer file, replaced atomically, names the current generation; folders appear complete (written
under a temporary name, then renamed) or not at all. An old generation's files can be deleted
while a process still maps them: the pages stay valid until that process lets go.

``generation.json`` holds a CRC-32 of each array, checked whenever a generation is mapped: a
file damaged in place (a disk's bad block, a stray write; the right size, wrong values) counts
as no generation, where its values would have indexed past the arrays' ends and crashed, with a
segmentation fault, every process serving or extending it, and each restarted one again.
Checking costs a read of the files (about 15 ms per 64 MB), which mapping them for use reads
anyway.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache_service.host.prior_files import fsync, safe_name, stale_tmp, sync_folder
from indexer.lifetime_index import LifetimeIndexes, LogId
from indexer.ngram_table import NgramTable, NgramTableConfig
from indexer.suffix_array import SuffixIndex
from indexer.tokens import SEPARATOR

# 2: suffix arrays rank separators apart, so a generation can be extended by the next one.
FORMAT = 2
CURRENT = "current.json"
META = "generation.json"
LOCK = "build.lock"


@dataclass(frozen=True)
class Generation:
    """One published generation, its arrays memory-mapped."""

    indexes: LifetimeIndexes
    log: str  # identity of the log whose positions ``through`` refers to
    through: LogId  # covers every log entry up to and including this position
    folder: Path


def namespace_dir(root: Path, namespace: str) -> Path:
    """Where a namespace's generations live under ``root``."""
    return root / safe_name(namespace)


def save(indexes: LifetimeIndexes, *, log: str, through: LogId, ns_dir: Path) -> Path:
    """Write a generation and make it current; returns its folder. A folder of the same name
    (only a damaged one: a valid one would have been built upon) is replaced."""
    name = f"g{through[0]}-{through[1]}-{indexes.version}"
    folder = ns_dir / name
    tmp = ns_dir / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a dead process that had this pid
    tmp.mkdir(parents=True)
    try:
        _write(indexes, log, through, tmp)
        sync_folder(tmp)  # else a power loss can leave the renamed folder with files of no bytes
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # and the space it held with it
        raise
    if folder.exists():
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    fsync(ns_dir)
    pointer = ns_dir / f".{CURRENT}.{os.getpid()}.tmp"
    pointer.write_text(json.dumps({"folder": name}))
    fsync(pointer)
    os.replace(pointer, ns_dir / CURRENT)
    fsync(ns_dir)
    return folder


def _arrays(indexes: LifetimeIndexes) -> dict[str, np.ndarray]:
    """A generation's arrays by file name (without ``.npy``)."""
    table = {f"table_{key}": array for key, array in indexes.table.arrays().items()}
    return {"tokens": indexes.suffix.tokens, "sa": indexes.suffix.suffix_array} | table


def checksum(array: np.ndarray) -> int:
    """CRC-32 of an array's bytes, as saved (C order)."""
    return zlib.crc32(np.ascontiguousarray(array).data)


def _write(indexes: LifetimeIndexes, log: str, through: LogId, tmp: Path) -> None:
    sums = {}
    for name, array in _arrays(indexes).items():
        np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        sums[name] = checksum(array)
    c = indexes.table.config
    meta = {
        "format": FORMAT,
        "log": log,
        "through": list(through),
        "version": indexes.version,
        "table_version": indexes.table_built_at,
        "build_seconds": indexes.build_seconds,
        "crc32": sums,
        "table": {"leader_len": c.leader_len, "follower_len": c.follower_len, "top_k": c.top_k}
        | {"min_count": c.min_count, "max_leaders": c.max_leaders},
    }
    (tmp / META).write_text(json.dumps(meta))


def current_name(ns_dir: Path) -> str | None:
    """The current generation's folder name (``None`` when none was published); ``ValueError``
    when the pointer is damaged."""
    try:
        name = json.loads((ns_dir / CURRENT).read_text())["folder"]
    except FileNotFoundError:
        return None
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{ns_dir / CURRENT}: not a generation pointer: {exc}") from exc
    if not isinstance(name, str) or "/" in name or not name.startswith("g"):
        raise ValueError(f"{ns_dir / CURRENT}: bad folder name {name!r}")
    return name


def current(ns_dir: Path) -> Generation | None:
    """The current generation, mapped; ``None`` when none was published. ``ValueError`` when
    the pointer or the folder it names is damaged (or was replaced while being read)."""
    name = current_name(ns_dir)
    return None if name is None else load(ns_dir / name)


def load(folder: Path) -> Generation:
    """A generation written by :func:`save`, memory-mapped read-only."""
    try:
        meta = json.loads((folder / META).read_text())
        tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        sa = np.load(folder / "sa.npy", mmap_mode="r")
        arrays = {n: np.load(folder / f"table_{n}.npy", mmap_mode="r") for n in NgramTable.ARRAYS}
        table = NgramTable.from_arrays(NgramTableConfig(**meta["table"]), arrays)
        through = (int(meta["through"][0]), int(meta["through"][1]))
        log, version, seconds = str(meta["log"]), int(meta["version"]), float(meta["build_seconds"])
        table_version = int(meta.get("table_version", version))
        extendable = meta.get("format") == FORMAT  # older ones sorted separators as tokens
        sums = meta.get("crc32")  # older releases wrote none
        if sums is not None:
            mapped = {"tokens": tokens, "sa": sa} | {f"table_{n}": a for n, a in arrays.items()}
            damaged = sorted(n for n, a in mapped.items() if checksum(a) != int(sums[n]))
            if damaged:
                raise ValueError(f"{', '.join(damaged)} changed since written (checksum)")
    except (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder}: not a saved generation: {exc}") from exc  # EOFError: an empty file
    if tokens.dtype != np.int32 or tokens.ndim != 1 or tokens.size == 0 or tokens[-1] != SEPARATOR:
        raise ValueError(f"{folder}: tokens must be 1-D int32 ending with a separator")
    if sa.dtype != np.int32 or sa.shape != tokens.shape:
        raise ValueError(f"{folder}: the suffix array does not match the tokens")
    suffix = SuffixIndex(tokens, sa)
    indexes = LifetimeIndexes(suffix, table, version, seconds, table_version, extendable=extendable)
    return Generation(indexes, log, through, folder)


def prune(ns_dir: Path, keep: set[Path]) -> int:
    """Delete generation folders not in ``keep`` and temporary ones left by dead writers;
    returns how many went."""
    gone = 0
    now = time.time()
    for path in ns_dir.iterdir():
        if (path.is_dir() and path.name.startswith("g") and path not in keep) or stale_tmp(path, now):
            shutil.rmtree(path, ignore_errors=True)
            gone += 1
    return gone


@contextmanager
def build_lock(ns_dir: Path, *, wait: bool) -> Iterator[bool]:
    """Hold the namespace's build lock (one builder per host at a time); yields whether it was
    taken (always, with ``wait``). The kernel drops it if the holder dies."""
    ns_dir.mkdir(parents=True, exist_ok=True)
    with open(ns_dir / LOCK, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

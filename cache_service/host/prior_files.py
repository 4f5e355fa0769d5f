"""Static priors as folders of ``.npy`` files that every server process maps read-only.

A prior is the biggest thing a process holds (a ShareGPT prior is 169 MB). Saved once per
version into a folder beside the other processes, and loaded with ``mmap``, its pages are in
memory once per host however many processes serve it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Literal

import numpy as np

from indexer.ngram_table import NgramTable, NgramTableConfig
from indexer.prior import StaticPrior

META = "prior.json"
# A file name may have 255 bytes, and escaping triples a namespace's (128 characters) at worst.
MAX_NAME_BYTES = 200
STALE_TMP_S = 3600.0  # a temporary folder this old was left by a process that died mid-write


def safe_name(namespace: str) -> str:
    """A namespace as one file name (``/`` and other characters escaped). One whose escaped form
    is longer than ``MAX_NAME_BYTES`` keeps a prefix of it and a hash of the whole name, after a
    ``+`` (which escaping never leaves), so it is never another namespace's name.

    >>> safe_name("acme/llama2")
    'acme%2fllama2'
    >>> len(safe_name("a" + ":" * 127))
    200
    """
    escaped = re.sub(r"[^A-Za-z0-9_.-]", lambda m: f"%{ord(m.group()):02x}", namespace)
    if len(escaped) <= MAX_NAME_BYTES:
        return escaped  # as always: folders saved before stay valid
    digest = hashlib.sha256(namespace.encode()).hexdigest()[:32]
    return f"{escaped[: MAX_NAME_BYTES - len(digest) - 1]}+{digest}"


def folder_for(root: Path, namespace: str, version: int) -> Path:
    """Where a namespace's prior version lives under ``root``."""
    return root / safe_name(namespace) / f"v{version}"


def save(prior: StaticPrior, folder: Path) -> None:
    """Write one ``.npy`` file per array; the folder appears complete or not at all (a failed
    write, on a full disk say, leaves nothing)."""
    if folder.exists():
        return
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by this process's failed write, or a dead one's with this pid
    tmp.mkdir(parents=True)
    try:
        _write(prior, tmp)
        sync_folder(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # and the space it held with it
        raise
    try:
        os.rename(tmp, folder)
    except OSError:  # another process published the same version first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    fsync(folder.parent)


def _write(prior: StaticPrior, tmp: Path) -> None:
    tables = []
    for i, table in enumerate(prior.tables):
        c = table.config
        tables.append(
            {"leader_len": c.leader_len, "follower_len": c.follower_len, "top_k": c.top_k}
            | {"min_count": c.min_count, "max_leaders": c.max_leaders}
        )
        for name, array in table.arrays().items():
            np.save(tmp / f"t{i}_{name}.npy", array, allow_pickle=False)
    for name, array in prior.index_arrays().items():
        np.save(tmp / f"index_{name}.npy", array, allow_pickle=False)
    (tmp / META).write_text(json.dumps({"source_tokens": prior.source_tokens, "tables": tables}))


def fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """Flush a folder's files and entries to disk before it is published by a rename: else a
    power loss can leave the renamed folder with files of no bytes."""
    for path in folder.iterdir():
        fsync(path)
    fsync(folder)


def stale_tmp(path: Path, now: float) -> bool:
    """Whether ``path`` is a temporary folder left by a writer that died mid-write."""
    try:
        return path.name.endswith(".tmp") and path.is_dir() and now - path.stat().st_mtime > STALE_TMP_S
    except FileNotFoundError:  # removed meanwhile
        return False


def prune(ns_dir: Path, version: int) -> int:
    """Delete a namespace's versions older than the newest one before ``version`` (that one
    stays: a process not yet moved on, or a rollback, may map it; a process mapping an older
    one keeps its pages until it lets go) and temporary folders left by dead writers; returns
    how many went."""
    older = sorted(v for v in map(_version, ns_dir.iterdir()) if v is not None and v < version)
    now = time.time()
    gone = [ns_dir / f"v{v}" for v in older[:-1]] + [p for p in ns_dir.iterdir() if stale_tmp(p, now)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return len(gone)


def _version(path: Path) -> int | None:
    digits = path.name[1:]
    return int(digits) if path.name.startswith("v") and digits.isdigit() else None


def load(folder: Path, *, mmap: bool = True) -> StaticPrior:
    """A prior written by :func:`save`, memory-mapped read-only by default; ``ValueError``
    when the folder is incomplete or inconsistent."""
    mode: Literal["r"] | None = "r" if mmap else None
    try:
        meta = json.loads((folder / META).read_text())
        tables = tuple(
            NgramTable.from_arrays(
                NgramTableConfig(**cfg),
                {n: np.load(folder / f"t{i}_{n}.npy", mmap_mode=mode) for n in NgramTable.ARRAYS},
            )
            for i, cfg in enumerate(meta["tables"])
        )
        index = {n: np.load(folder / f"index_{n}.npy", mmap_mode=mode) for n in ("keys", "owner", "slot")}
        return StaticPrior.from_parts(tuple(tables), int(meta["source_tokens"]), index)
    except (OSError, EOFError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder}: not a saved prior: {exc}") from exc

"""Static priors as folders of ``.npy`` files that every server process maps read-only.

A prior is the biggest thing a process holds (a ShareGPT prior is 169 MB). Saved once per
version into a folder beside the other processes, and loaded with ``mmap``, its pages are in
memory once per host however many processes serve it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

import numpy as np

from indexer.ngram_table import NgramTable, NgramTableConfig
from indexer.prior import StaticPrior

META = "prior.json"


def safe_name(namespace: str) -> str:
    """A namespace as one file name (``/`` and other characters escaped).

    >>> safe_name("acme/llama2")
    'acme%2fllama2'
    """
    return re.sub(r"[^A-Za-z0-9_.-]", lambda m: f"%{ord(m.group()):02x}", namespace)


def folder_for(root: Path, namespace: str, version: int) -> Path:
    """Where a namespace's prior version lives under ``root``."""
    return root / safe_name(namespace) / f"v{version}"


def save(prior: StaticPrior, folder: Path) -> None:
    """Write one ``.npy`` file per array; the folder appears complete or not at all."""
    if folder.exists():
        return
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True)
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
    try:
        os.rename(tmp, folder)
    except OSError:  # another process published the same version first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


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
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder}: not a saved prior: {exc}") from exc

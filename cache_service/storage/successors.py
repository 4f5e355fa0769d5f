"""A namespace's successor rows (:mod:`indexer.successors`) in Redis, shared by its replicas.

Rows live in one hash, token id -> packed row (last writer wins per token). Every write also
appends the tokens it wrote to a capped change stream, so a replica reads only the rows other
replicas changed since it last looked, not the whole table. Rows are soft state: a replica that
fell more than the stream's length behind misses some changes until the next write of those
tokens, and a fresh one reads the whole hash.
"""

from __future__ import annotations

import numpy as np

from cache_service.storage import keys
from cache_service.storage.clients import StorageClient

CHANGES_MAXLEN = 10_000  # change entries kept (approximately: trimmed with ~)


def save(client: StorageClient, ns: str, writer: str, tokens: np.ndarray, packed: list[bytes]) -> str | None:
    """Write rows and announce them; the change entry's id (``None`` when there was nothing)."""
    if not tokens.size:
        return None
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.successors(ns), mapping={str(int(t)): row for t, row in zip(tokens, packed, strict=True)})
    pipe.xadd(
        keys.successor_changes(ns),
        {b"w": writer.encode(), b"t": np.ascontiguousarray(tokens, dtype="<i4").tobytes()},
        maxlen=CHANGES_MAXLEN,
        approximate=True,
    )
    _, entry = pipe.execute()
    return entry.decode() if isinstance(entry, bytes) else str(entry)


def read_all(client: StorageClient, ns: str) -> tuple[np.ndarray, list[bytes], str]:
    """Every stored row (tokens, packed rows) and the change stream's last id ("0-0": none)."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.successors(ns))
    pipe.xrevrange(keys.successor_changes(ns), count=1)
    rows, last = pipe.execute()
    tokens = np.array([int(t) for t in rows], dtype=np.int32)
    return tokens, list(rows.values()), _id(last[0][0]) if last else "0-0"


def read_changes(
    client: StorageClient, ns: str, after: str, writer: str, count: int
) -> tuple[np.ndarray, list[bytes], str]:
    """Rows other writers changed after the change entry ``after``: (tokens, packed rows, the
    last entry read)."""
    entries = client.xrange(keys.successor_changes(ns), min=f"({after}", count=count)
    if not entries:
        return np.zeros(0, dtype=np.int32), [], after
    mine = writer.encode()
    parts = [
        np.frombuffer(_bytes(fields[b"t"]), dtype="<i4")
        for _, fields in entries
        if fields and fields.get(b"w") != mine and len(fields.get(b"t", b"")) % 4 == 0
    ]
    last = _id(entries[-1][0] or b"0-0")
    tokens = np.unique(np.concatenate(parts)).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
    if not tokens.size:
        return tokens, [], last
    rows = client.hmget(keys.successors(ns), [str(int(t)) for t in tokens])
    found = [(i, _bytes(r)) for i, r in enumerate(rows) if r is not None]
    return tokens[[i for i, _ in found]], [r for _, r in found], last


def _id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()

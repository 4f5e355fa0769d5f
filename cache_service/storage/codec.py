"""Pure byte layouts of what draftcache stores: token arrays and LRU tables (a session's whole
layout is :mod:`cache_service.storage.stored_session`).

Every ``decode_*`` raises :class:`~cache_service.storage.errors.StorageCorrupt` on input it did
not produce; every ``encode_*`` raises ``ValueError`` on input it cannot represent.
"""

from __future__ import annotations

import struct

import numpy as np

from cache_service.storage.errors import StorageCorrupt
from indexer.session_cache import TableColumns, TableItems

Table = TableItems | TableColumns  # LruTable.items() or LruTable.columns()

_LE_INT32 = np.dtype("<i4")
_INT32_MAX = int(np.iinfo(np.int32).max)
_TABLE_MAGIC = b"DCLT"
_TABLE_FORMAT = 1
# magic, format, reserved, leaders, followers, leader tokens, follower tokens
_TABLE_HEADER = struct.Struct("<4sHHIIII")


def tokens_to_bytes(tokens: np.ndarray) -> bytes:
    """Raw little-endian int32 bytes of a 1-D int32 array.

    >>> tokens_to_bytes(np.array([1, 256], dtype=np.int32))
    b'\\x01\\x00\\x00\\x00\\x00\\x01\\x00\\x00'
    """
    if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.ndim != 1:
        raise ValueError("tokens must be a 1-D int32 numpy array")
    return tokens.astype(_LE_INT32, copy=False).tobytes()


def tokens_from_bytes(raw: bytes, *, what: str = "tokens") -> np.ndarray:
    """Inverse of :func:`tokens_to_bytes`: a read-only int32 view over ``raw``.

    >>> tokens_from_bytes(b"\\x01\\x00\\x00\\x00").tolist()
    [1]
    """
    if len(raw) % 4:
        raise StorageCorrupt(f"{what}: {len(raw)} bytes is not a whole number of int32 tokens")
    return np.frombuffer(raw, dtype=_LE_INT32).astype(np.int32, copy=False)


def as_bytes(value: object, *, what: str) -> bytes:
    """``value`` if Redis answered bytes (it always does with ``decode_responses=False``)."""
    if not isinstance(value, bytes):
        raise StorageCorrupt(f"{what}: expected bytes from Redis, got {type(value).__name__}")
    return value


def as_fields(value: object, *, what: str) -> dict[bytes, bytes]:
    """A hash or stream entry's fields as ``{bytes: bytes}``."""
    if not isinstance(value, dict):
        raise StorageCorrupt(f"{what}: expected a field map from Redis, got {type(value).__name__}")
    return {as_bytes(k, what=what): as_bytes(v, what=what) for k, v in value.items()}


def _int32_array(values: np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < -_INT32_MAX - 1 or arr.max() > _INT32_MAX):
        raise ValueError(f"{what}: values must fit in int32")
    return arr.astype(_LE_INT32)


def encode_table(table: Table) -> bytes:
    """Serialize a table (``LruTable.columns()``, or its ``items()``: oldest leader first) into
    one compact blob.

    Layout: a 24-byte header, then little-endian int32 columns ``leader_lens``,
    ``followers_per_leader``, ``follower_lens``, ``counts``, ``leader_tokens``,
    ``follower_tokens``. Counts saturate at 2**31 - 1 (they are weights, not ledgers).

    >>> decode_table(encode_table([((1, 2), [((3, 4), 2), ((5,), 1)])]))
    [((1, 2), [((3, 4), 2), ((5,), 1)])]
    """
    cols = table if isinstance(table, TableColumns) else TableColumns.of_items(table)
    if cols.counts.size and cols.counts.min() < 0:
        raise ValueError(f"follower counts must be >= 0, got {int(cols.counts.min())}")
    header = _TABLE_HEADER.pack(
        _TABLE_MAGIC,
        _TABLE_FORMAT,
        0,
        cols.leader_lens.size,
        cols.counts.size,
        cols.leader_tokens.size,
        cols.follower_tokens.size,
    )
    columns = (
        cols.leader_lens,
        cols.fanout,
        cols.follower_lens,
        np.minimum(cols.counts, _INT32_MAX),
        cols.leader_tokens,
        cols.follower_tokens,
    )
    return header + b"".join(_int32_array(c, "table").tobytes() for c in columns)


def _table_columns(blob: bytes) -> list[np.ndarray]:
    if len(blob) < _TABLE_HEADER.size:
        raise StorageCorrupt(f"table blob of {len(blob)} bytes is shorter than its header")
    magic, fmt, _, n_lead, n_fol, n_lt, n_ft = _TABLE_HEADER.unpack_from(blob)
    if magic != _TABLE_MAGIC or fmt != _TABLE_FORMAT:
        raise StorageCorrupt(f"table blob has magic {magic!r} format {fmt}, expected {_TABLE_MAGIC!r} {_TABLE_FORMAT}")
    sizes = (n_lead, n_lead, n_fol, n_fol, n_lt, n_ft)
    if len(blob) != _TABLE_HEADER.size + 4 * sum(sizes):
        raise StorageCorrupt(f"table blob is {len(blob)} bytes, its header describes {4 * sum(sizes)} + header")
    body = np.frombuffer(blob, dtype=_LE_INT32, offset=_TABLE_HEADER.size)
    columns = np.split(body, np.cumsum(sizes)[:-1])
    leader_lens, fanout, follower_lens, counts = columns[:4]
    for col in (leader_lens, fanout, follower_lens, counts):
        if col.size and col.min() < 0:
            raise StorageCorrupt("table blob has negative lengths or counts")
    if leader_lens.sum() != n_lt or fanout.sum() != n_fol or follower_lens.sum() != n_ft:
        raise StorageCorrupt("table blob lengths do not add up to its token columns")
    return columns


def decode_columns(blob: bytes) -> TableColumns:
    """Inverse of :func:`encode_table`, as columns (int64, as ``TableColumns.of_items`` makes them)."""
    return TableColumns(*(c.astype(np.int64) for c in _table_columns(blob)))


def decode_table(blob: bytes) -> TableItems:
    """Inverse of :func:`encode_table`; replay with ``LruTable.add(leader, follower, count)``."""
    return decode_columns(blob).items()


def empty_columns() -> TableColumns:
    """A table with no entries."""
    return TableColumns.of_items([])

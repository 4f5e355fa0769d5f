"""Static priors as versioned, chunked blobs with a current and a previous version.

A prior (``StaticPrior.to_bytes()``, ~200 MB at the defaults) is written as parts of at most
``part_size`` bytes, each its own string key, so no single command carries more than one part.
Redis refuses any bulk string over ``proto-max-bulk-len`` (512 MB by default), so a prior larger
than that only works chunked; parts also bound each command's latency and memory spike.

Parts are staged with a TTL, then one transaction makes them permanent and moves the
``current`` pointer (the old current becomes ``previous``, kept for rollback). A writer that
dies while staging leaves nothing behind once the TTL runs out.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.typing import EncodableT, FieldT

from cache_service.storage import codec, keys
from cache_service.storage.clients import StorageClient, transaction
from cache_service.storage.errors import StorageCorrupt, StorageUnavailable
from indexer.prior import blob_digest

_READ_ATTEMPTS = 3  # a version may be dropped under a reader only by two publishes in a row


@dataclass(frozen=True, kw_only=True)
class PriorMeta:
    """What a reader checks a reassembled blob against.

    >>> meta = PriorMeta.describe(b"abcde", part_size=2)
    >>> meta.parts, meta.size
    (3, 5)
    """

    parts: int
    size: int
    part_size: int
    digest: str  # blake2b-256, hex

    @classmethod
    def describe(cls, blob: bytes | memoryview, *, part_size: int) -> PriorMeta:
        return cls(
            parts=-(-len(blob) // part_size),
            size=len(blob),
            part_size=part_size,
            digest=blob_digest(blob),
        )

    def fields(self) -> dict[FieldT, EncodableT]:
        return {"parts": self.parts, "size": self.size, "part_size": self.part_size, "digest": self.digest}

    @classmethod
    def parse(cls, fields: dict[bytes, bytes], *, where: str) -> PriorMeta:
        try:
            meta = cls(
                parts=int(fields[b"parts"]),
                size=int(fields[b"size"]),
                part_size=int(fields[b"part_size"]),
                digest=fields[b"digest"].decode("ascii"),
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise StorageCorrupt(f"{where}: prior metadata does not decode: {exc!r}") from exc
        if meta.part_size < 1 or meta.parts != -(-meta.size // meta.part_size):
            raise StorageCorrupt(f"{where}: prior metadata is inconsistent: {meta}")
        return meta


def _version(raw: bytes | str | None, key: str) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise StorageCorrupt(f"{key} holds {raw!r}, not a version number") from exc


def current_version(client: StorageClient, ns: str) -> int | None:
    key = keys.prior_current(ns)
    return _version(client.get(key), key)


def _version_keys(ns: str, version: int, parts: int) -> list[str]:
    return [keys.prior_meta(ns, version)] + [keys.prior_part(ns, version, i) for i in range(parts)]


def stage(client: StorageClient, ns: str, blob: bytes, *, part_size: int, ttl_s: int) -> tuple[int, PriorMeta]:
    """Write ``blob`` under a fresh version number, every key expiring after ``ttl_s``."""
    version = int(client.incr(keys.prior_seq(ns)))
    view = memoryview(blob)
    meta = PriorMeta.describe(view, part_size=part_size)
    for i in range(meta.parts):
        client.set(keys.prior_part(ns, version, i), view[i * part_size : (i + 1) * part_size], ex=ttl_s)
    with transaction(client, keys.prior_meta(ns, version)) as pipe:
        pipe.hset(keys.prior_meta(ns, version), mapping=meta.fields())
        pipe.expire(keys.prior_meta(ns, version), ttl_s)
        pipe.execute()
    return version, meta


def publish(client: StorageClient, ns: str, version: int, parts: int) -> None:
    """Make a staged version permanent and current; drop the version two publishes old."""
    cur_key, prev_key = keys.prior_current(ns), keys.prior_previous(ns)
    staged = _version_keys(ns, version, parts)
    with transaction(client, cur_key) as pipe:
        while True:
            try:
                pipe.watch(cur_key, prev_key, *staged)  # a staged key expiring now aborts the switch
                if pipe.exists(*staged) != len(staged):
                    raise StorageUnavailable(f"staged prior {version} of {ns!r} expired before publishing")
                current, previous = _version(pipe.get(cur_key), cur_key), _version(pipe.get(prev_key), prev_key)
                pipe.multi()
                for key in staged:
                    pipe.persist(key)
                pipe.set(cur_key, version)
                if current is not None:
                    pipe.set(prev_key, current)
                pipe.execute()
                break
            except redis.WatchError:
                continue
    if previous is not None and previous not in (current, version):
        drop_version(client, ns, previous)


def drop_version(client: StorageClient, ns: str, version: int) -> None:
    meta = codec.as_fields(client.hgetall(keys.prior_meta(ns, version)), what=f"prior {version} of {ns!r}")
    raw_parts = meta.get(b"parts", b"0")
    parts = int(raw_parts) if raw_parts.isdigit() else 0  # unreadable metadata: drop what we can name
    # Parts first, metadata last: an interrupted drop can be finished by calling this again.
    client.unlink(*[keys.prior_part(ns, version, i) for i in range(parts)], keys.prior_meta(ns, version))


def rollback(client: StorageClient, ns: str) -> int | None:
    """Swap ``current`` and ``previous``; the new current version, or ``None`` if no previous."""
    cur_key, prev_key = keys.prior_current(ns), keys.prior_previous(ns)
    with transaction(client, cur_key) as pipe:
        while True:
            try:
                pipe.watch(cur_key, prev_key)
                current, previous = _version(pipe.get(cur_key), cur_key), _version(pipe.get(prev_key), prev_key)
                if previous is None or current is None:
                    pipe.unwatch()
                    return None
                pipe.multi()
                pipe.set(cur_key, previous)
                pipe.set(prev_key, current)
                pipe.execute()
                return previous
            except redis.WatchError:
                continue


def _read_version(client: StorageClient, ns: str, version: int) -> bytearray | None:
    """The verified blob of ``version``, or ``None`` if it (or a part) is gone."""
    where = f"prior {version} of namespace {ns!r}"
    raw_meta = codec.as_fields(client.hgetall(keys.prior_meta(ns, version)), what=where)
    if not raw_meta:
        return None
    meta = PriorMeta.parse(raw_meta, where=where)
    blob = bytearray(meta.size)  # filled in place: peak memory is the blob plus one part
    for i in range(meta.parts):
        raw = client.get(keys.prior_part(ns, version, i))
        if raw is None:
            return None
        part = codec.as_bytes(raw, what=where)
        expected = min(meta.part_size, meta.size - i * meta.part_size)
        if len(part) != expected:
            raise StorageCorrupt(f"{where}: part {i} is {len(part)} bytes, expected {expected}")
        blob[i * meta.part_size : i * meta.part_size + expected] = part
    if blob_digest(blob) != meta.digest:
        raise StorageCorrupt(f"{where}: checksum mismatch")
    return blob


def read_current(client: StorageClient, ns: str) -> tuple[int, bytearray] | None:
    for _ in range(_READ_ATTEMPTS):
        version = current_version(client, ns)
        if version is None:
            return None
        blob = _read_version(client, ns, version)
        if blob is not None:
            return version, blob
        if current_version(client, ns) == version:
            raise StorageCorrupt(f"prior {version} of namespace {ns!r} is current but incomplete")
    raise StorageUnavailable(f"the prior of namespace {ns!r} kept changing while being read; retry")


def read_range(
    client: StorageClient, ns: str, version: int, offset: int, length: int
) -> tuple[PriorMeta, bytes] | None:
    """``length`` bytes (fewer at the end) of ``version``'s blob from ``offset``, and its
    metadata, or ``None`` where the version (or a part it needs) is gone. Each part is read
    with GETRANGE: a page costs what it carries, not its parts' size. The blob is checked
    against ``meta.digest`` by whoever reassembles it."""
    where = f"prior {version} of namespace {ns!r}"
    raw_meta = codec.as_fields(client.hgetall(keys.prior_meta(ns, version)), what=where)
    if not raw_meta:
        return None
    meta = PriorMeta.parse(raw_meta, where=where)
    if offset >= meta.size:
        return meta, b""
    end = min(meta.size, offset + length)
    out = bytearray()
    while offset + len(out) < end:
        at = offset + len(out)
        part, start = divmod(at, meta.part_size)
        stop = min(meta.part_size, start + end - at)  # GETRANGE's end is inclusive
        raw = codec.as_bytes(client.getrange(keys.prior_part(ns, version, part), start, stop - 1), what=where)
        if not raw:  # a part never holds nothing: the version went
            return None
        if len(raw) != stop - start:
            raise StorageCorrupt(f"{where}: part {part} is shorter than its metadata says")
        out += raw
    return meta, bytes(out)

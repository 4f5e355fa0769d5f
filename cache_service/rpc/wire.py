"""A batch of draft trees in protobuf wire format, written by one compiled loop.

Building ``pb.Tree`` messages field by field costs about 8 us per tree (four Python lists, then
the message); a decode step of 32 sequences spends a quarter of a millisecond on it. The wire
format of ``repeated Tree trees = 1`` is simple enough to write directly: per tree a
length-delimited submessage holding packed varints (tokens, parents), the sources as bytes and
the scores as packed little-endian float32. The trees drafted ahead (``repeated Prefetched
prefetched = 2``: per item its accepted paths, packed, each with a tree) are written the same
way. The bytes are exactly what protobuf itself writes for the same message (tests compare
them), so they parse back into ``pb.DraftResponse``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from indexer.tree_builder import DraftTree, whole_batch

_TAG_REQUEST_ID = 0x08  # StreamResponse.request_id: field 1, varint
_TAG_STREAM_DRAFT = 0x1A  # StreamResponse.draft: field 3, length-delimited
_TAG_TREES = 0x0A  # DraftResponse.trees: field 1, length-delimited
_TAG_TOKENS = 0x0A  # Tree.tokens: field 1, packed
_TAG_PARENTS = 0x12  # Tree.parents: field 2, packed
_TAG_SOURCES = 0x1A  # Tree.sources: field 3, bytes
_TAG_SCORES = 0x22  # Tree.scores: field 4, packed float
_TAG_PREFETCHED = 0x12  # DraftResponse.prefetched: field 2, length-delimited
_TAG_PREFETCH_ITEMS = 0x0A  # Prefetched.items: field 1, length-delimited
_TAG_ACCEPTED = 0x0A  # Prefetch.accepted: field 1, packed
_TAG_PREFETCH_TREE = 0x12  # Prefetch.tree: field 2, length-delimited


@njit(cache=True, nogil=True, inline="always")
def _varint_size(v: int) -> int:
    """Bytes of a varint; a negative int32 is sign-extended to 64 bits (10 bytes)."""
    if v < 0:
        return 10
    n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


@njit(cache=True, nogil=True, inline="always")
def _put_varint(buf: np.ndarray, at: int, v: int) -> int:
    """Write ``v`` (at least -2**31) at ``at``; returns the next position."""
    u = np.uint64(v) if v >= 0 else np.uint64(v + 0x100000000) | np.uint64(0xFFFFFFFF00000000)
    while u >= np.uint64(0x80):
        buf[at] = np.uint8((u & np.uint64(0x7F)) | np.uint64(0x80))
        u >>= np.uint64(7)
        at += 1
    buf[at] = np.uint8(u)
    return at + 1


@njit(cache=True, nogil=True)
def _packed_size(values: np.ndarray, lo: int, hi: int) -> int:
    n = 0
    for i in range(lo, hi):
        n += _varint_size(values[i])
    return n


@njit(cache=True, nogil=True)
def _put_packed(buf: np.ndarray, w: int, tag: int, values: np.ndarray, lo: int, hi: int, length: int) -> int:
    """Write a packed field of ``values[lo:hi]`` (``length``: their :func:`_packed_size`) at
    ``w``; returns the next position."""
    buf[w] = tag
    w = _put_varint(buf, w + 1, length)
    for i in range(lo, hi):
        w = _put_varint(buf, w, values[i])
    return w


@njit(cache=True, nogil=True)
def _tree_body(tokens: np.ndarray, parents: np.ndarray, at: int, n: int) -> tuple[int, int, int]:
    """A ``Tree`` message of nodes ``[at, at + n)``: its packed tokens' and parents' byte
    lengths and its body's."""
    tok_len = _packed_size(tokens, at, at + n)
    par_len = _packed_size(parents, at, at + n)
    body = 0
    if n:  # proto3 leaves empty fields out
        body += 1 + _varint_size(tok_len) + tok_len
        body += 1 + _varint_size(par_len) + par_len
        body += 1 + _varint_size(n) + n
        body += 1 + _varint_size(4 * n) + 4 * n
    return tok_len, par_len, body


@njit(cache=True, nogil=True)
def _put_tree_body(
    buf: np.ndarray,
    w: int,
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    score_bytes: np.ndarray,
    at: int,
    n: int,
    tok_len: int,
    par_len: int,
) -> int:
    """Write the body :func:`_tree_body` measured at ``w``; returns the next position."""
    if n == 0:
        return w
    w = _put_packed(buf, w, _TAG_TOKENS, tokens, at, at + n, tok_len)
    w = _put_packed(buf, w, _TAG_PARENTS, parents, at, at + n, par_len)
    buf[w] = _TAG_SOURCES
    w = _put_varint(buf, w + 1, n)
    for i in range(at, at + n):
        buf[w] = sources[i]
        w += 1
    buf[w] = _TAG_SCORES
    w = _put_varint(buf, w + 1, 4 * n)
    for i in range(4 * at, 4 * (at + n)):
        buf[w] = score_bytes[i]
        w += 1
    return w


@njit(cache=True, nogil=True)
def encode_tree_batch(
    tokens: np.ndarray, parents: np.ndarray, sources: np.ndarray, score_bytes: np.ndarray, sizes: np.ndarray
) -> np.ndarray:
    """``repeated Tree`` (field 1) for trees stored back to back: ``sizes[k]`` nodes each, with
    ``score_bytes`` the float32 scores viewed as bytes."""
    count = sizes.size
    lens = np.empty((count, 3), dtype=np.int64)  # per tree: packed tokens, packed parents, body
    total = 0
    at = 0
    for k in range(count):
        lens[k, 0], lens[k, 1], lens[k, 2] = _tree_body(tokens, parents, at, sizes[k])
        total += 1 + _varint_size(lens[k, 2]) + lens[k, 2]
        at += sizes[k]
    buf = np.empty(total, dtype=np.uint8)
    w = 0
    at = 0
    for k in range(count):
        buf[w] = _TAG_TREES
        w = _put_varint(buf, w + 1, lens[k, 2])
        w = _put_tree_body(buf, w, tokens, parents, sources, score_bytes, at, sizes[k], lens[k, 0], lens[k, 1])
        at += sizes[k]
    return buf


@njit(cache=True, nogil=True)
def encode_prefetched_batch(
    per_item: np.ndarray,
    path_tokens: np.ndarray,
    path_ends: np.ndarray,
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    score_bytes: np.ndarray,
    sizes: np.ndarray,
) -> np.ndarray:
    """``repeated Prefetched prefetched`` (field 2): item ``i`` holds the next ``per_item[i]``
    entries, entry ``e`` the accepted path ending at ``path_ends[e]`` in ``path_tokens`` and a
    tree of ``sizes[e]`` nodes (stored back to back, as :func:`encode_tree_batch` takes them)."""
    entries = sizes.size
    lens = np.empty((entries, 5), dtype=np.int64)  # tokens, parents, tree body, path, entry body
    at = 0
    p0 = 0
    for e in range(entries):
        lens[e, 0], lens[e, 1], lens[e, 2] = _tree_body(tokens, parents, at, sizes[e])
        lens[e, 3] = _packed_size(path_tokens, p0, path_ends[e])
        body = 1 + _varint_size(lens[e, 2]) + lens[e, 2]  # the tree, set even when empty
        if path_ends[e] > p0:
            body += 1 + _varint_size(lens[e, 3]) + lens[e, 3]
        lens[e, 4] = body
        at += sizes[e]
        p0 = path_ends[e]
    item_body = np.zeros(per_item.size, dtype=np.int64)
    total = 0
    e = 0
    for i in range(per_item.size):
        for _ in range(per_item[i]):
            item_body[i] += 1 + _varint_size(lens[e, 4]) + lens[e, 4]
            e += 1
        total += 1 + _varint_size(item_body[i]) + item_body[i]
    buf = np.empty(total, dtype=np.uint8)
    w = 0
    e = 0
    at = 0
    p0 = 0
    for i in range(per_item.size):
        buf[w] = _TAG_PREFETCHED
        w = _put_varint(buf, w + 1, item_body[i])
        for _ in range(per_item[i]):
            buf[w] = _TAG_PREFETCH_ITEMS
            w = _put_varint(buf, w + 1, lens[e, 4])
            if path_ends[e] > p0:
                w = _put_packed(buf, w, _TAG_ACCEPTED, path_tokens, p0, path_ends[e], lens[e, 3])
            buf[w] = _TAG_PREFETCH_TREE
            w = _put_varint(buf, w + 1, lens[e, 2])
            w = _put_tree_body(buf, w, tokens, parents, sources, score_bytes, at, sizes[e], lens[e, 0], lens[e, 1])
            at += sizes[e]
            p0 = path_ends[e]
            e += 1
    return buf


def _laid_out(trees: Sequence[DraftTree]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The trees' nodes end to end as the encoders take them: tokens, parents, sources, the
    scores' little-endian float32 bytes, and each tree's size. A whole draft batch, in order, is
    read from where it lies."""
    batch = whole_batch(trees) if trees else None
    if batch is not None:
        tokens, parents, sources, scores = batch.tokens, batch.parents, batch.sources, batch.scores
        sizes = np.diff(batch.offsets)
    elif trees:
        sizes = np.fromiter((len(t) for t in trees), dtype=np.int64, count=len(trees))
        tokens = np.concatenate([t.tokens for t in trees]).astype(np.int32, copy=False)
        parents = np.concatenate([t.parents for t in trees]).astype(np.int32, copy=False)
        sources = np.concatenate([t.sources for t in trees]).astype(np.uint8, copy=False)
        scores = np.concatenate([t.scores for t in trees])
    else:
        tokens = parents = np.zeros(0, dtype=np.int32)
        sources, scores, sizes = np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.float32), np.zeros(0, np.int64)
    return tokens, parents, sources, scores.astype("<f4", copy=False).view(np.uint8), sizes


def encode_trees(trees: Sequence[DraftTree]) -> bytes:
    """The trees as ``DraftResponse.trees`` on the wire (any message whose field 1 is
    ``repeated Tree`` parses them)."""
    if not trees:
        return b""
    return encode_tree_batch(*_laid_out(trees)).tobytes()


def encode_prefetched(ahead: Sequence[Mapping[tuple[int, ...], DraftTree]]) -> bytes:
    """What was drafted ahead for each item, as ``DraftResponse.prefetched`` on the wire (after
    the trees, the whole response: protobuf writes its fields in number order)."""
    per_item = np.fromiter((len(a) for a in ahead), dtype=np.int64, count=len(ahead))
    paths = [path for a in ahead for path in a]
    path_ends = np.cumsum([len(p) for p in paths], dtype=np.int64)
    path_tokens = np.fromiter((x for p in paths for x in p), dtype=np.int32, count=int(path_ends[-1]) if paths else 0)
    trees = _laid_out([t for a in ahead for t in a.values()])
    return encode_prefetched_batch(per_item, path_tokens, path_ends, *trees).tobytes()


class Encoded(NamedTuple):
    """A response already in wire format: the server sends ``data`` as it is (see
    :func:`serializer`), instead of parsing it into a message to serialise it again."""

    data: bytes


def serializer(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """A method's response serialiser that sends :class:`Encoded` responses unchanged."""
    if serialize is None:
        return None
    inner = serialize

    def write(message: Any) -> bytes:
        return message.data if isinstance(message, Encoded) else inner(message)

    return write


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def stream_draft(request_id: int, draft: bytes) -> Encoded:
    """``StreamResponse(request_id=..., draft=...)`` on the wire, the draft given as its
    encoded ``DraftResponse`` (as protobuf writes it: a zero id is left out)."""
    head = (bytes((_TAG_REQUEST_ID,)) + _varint(request_id)) if request_id else b""
    return Encoded(head + bytes((_TAG_STREAM_DRAFT,)) + _varint(len(draft)) + draft)


def warm_up() -> None:
    """Compile (or load from cache) the encoders now, not on a first request."""
    trees = [DraftTree.chain(np.array([1, 2], dtype=np.int32)), DraftTree.empty()]
    encode_trees(trees)
    encode_prefetched([{(): trees[0], (1,): trees[1]}, {}])

"""Draft trees read straight from their protobuf wire format, by one compiled loop.

Turning a ``pb.Tree`` into arrays field by field costs about 20 us per tree (``np.array`` walks
each repeated field element by element): a decode step of 32 sequences spends more than half a
millisecond of the decoder's time on it. Serializing the parsed response again is one C call,
and the bytes of ``repeated Tree trees = 1`` are simple to read: per tree a length-delimited
submessage of tokens and parents (varints, packed or not), sources (bytes) and scores (float32,
packed or not). Fields this reader does not know are skipped, as protobuf does.
"""

from __future__ import annotations

import itertools

import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from numba import njit

from indexer.drafter import DraftParams
from indexer.prespeculation import subtree
from indexer.tree_builder import DraftTree

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_EMPTY = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.float32))


def params_to_proto(p: DraftParams) -> pb.DraftParams:
    """Drafting knobs as a session's open sends them.

    >>> params_to_proto(DraftParams(chain=8)).chain
    8
    """
    return pb.DraftParams(
        budget=p.budget,
        max_depth=p.max_depth,
        min_score=p.min_score,
        depth_reserve=p.depth_reserve,
        chain=p.chain,
        chain_min_prob=p.chain_min_prob,
    )


@njit(cache=True, nogil=True)
def _varint(buf: np.ndarray, at: int, end: int) -> tuple[int, int]:
    """The varint at ``at`` (before ``end``) as a 64-bit value, and the position after it;
    position -1 when it is cut off or longer than 10 bytes."""
    value = np.uint64(0)
    shift = np.uint64(0)
    for i in range(at, min(end, at + 10)):
        b = np.uint64(buf[i])
        value |= (b & np.uint64(0x7F)) << shift
        if b < np.uint64(0x80):
            return int(np.int64(value)), i + 1
        shift += np.uint64(7)
    return 0, -1


@njit(cache=True, nogil=True)
def _skip(buf: np.ndarray, at: int, end: int, wire_type: int) -> int:
    """The position after a field's value of ``wire_type`` starting at ``at``; -1 if malformed."""
    if wire_type == _VARINT:
        return _varint(buf, at, end)[1]
    if wire_type == _FIXED64:
        return at + 8 if at + 8 <= end else -1
    if wire_type == _FIXED32:
        return at + 4 if at + 4 <= end else -1
    if wire_type == _LENGTH:
        n, at = _length(buf, at, end)
        return at + n if at >= 0 else -1
    return -1


@njit(cache=True, nogil=True)
def _length(buf: np.ndarray, at: int, end: int) -> tuple[int, int]:
    """A length prefix at ``at`` and the position after it; position -1 when it is malformed
    or runs past ``end``."""
    n, at = _varint(buf, at, end)
    return (n, at) if at >= 0 and 0 <= n <= end - at else (0, -1)


@njit(cache=True, nogil=True)
def _int32(v: int) -> int:
    """An int32 field's varint (negative values travel sign-extended to 64 bits)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


@njit(cache=True, nogil=True)
def decode_tree_batch(
    buf: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Every ``Tree`` in field 1 of a serialized message: ``(tokens, parents, sources, scores,
    offsets, error)``, tree ``k`` being nodes ``[offsets[k], offsets[k + 1])``. ``error`` is 0,
    or 1 for malformed bytes, 2 for a tree whose fields disagree in length (sources and scores
    are optional: a tree without them reads as sources 0 and scores 0)."""
    cap = buf.size  # a node takes at least one byte of each field
    tokens = np.empty(cap, dtype=np.int32)
    parents = np.empty(cap, dtype=np.int32)
    sources = np.empty(cap, dtype=np.uint8)
    scores = np.empty(cap, dtype=np.float32)
    offsets = np.zeros(cap + 1, dtype=np.int64)
    trees, error = _read_trees(buf, tokens, parents, sources, scores, offsets)
    if error:
        return tokens[:0], parents[:0], sources[:0], scores[:0], offsets[:1], error
    total = offsets[trees]
    return tokens[:total], parents[:total], sources[:total], scores[:total], offsets[: trees + 1], 0


@njit(cache=True, nogil=True)
def _read_int32s(
    buf: np.ndarray, at: int, end: int, wire_type: int, out: np.ndarray, n: int, cap: int
) -> tuple[int, int]:
    """A repeated int32 field's values after its key at ``at``: packed (``_LENGTH``) or one
    (``_VARINT``), written to ``out`` from index ``n`` on, below ``cap``. Returns the position
    after them (-1 when malformed, past ``end`` or past ``cap``) and the next free index."""
    stop = end
    if wire_type == _LENGTH:
        m, at = _length(buf, at, end)
        if at < 0:
            return -1, n
        stop = at + m
    while at < stop:
        v, at = _varint(buf, at, stop)
        if at < 0 or n >= cap:
            return -1, n
        out[n] = _int32(v)
        n += 1
        if wire_type == _VARINT:
            break
    return at, n


@njit(cache=True, nogil=True)
def _read_trees(
    buf: np.ndarray,
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    scores: np.ndarray,
    offsets: np.ndarray,
) -> tuple[int, int]:
    """:func:`decode_tree_batch` into arrays of ``buf.size`` nodes: ``(trees, error)``."""
    size = buf.size
    counts = np.zeros(4, dtype=np.int64)  # of the tree being read: tokens, parents, sources, scores
    trees = 0
    at = 0
    while at < size:
        key, at = _varint(buf, at, size)
        if at < 0:
            return 0, 1
        field, wire_type = key >> 3, key & 7
        if field != 1 or wire_type != _LENGTH:
            at = _skip(buf, at, size, wire_type)
            if at < 0:
                return 0, 1
            continue
        n, at = _length(buf, at, size)
        if at < 0:
            return 0, 1
        nodes, error = _read_tree(buf, at, at + n, offsets[trees], tokens, parents, sources, scores, counts)
        if error:
            return 0, error
        at += n
        trees += 1
        offsets[trees] = offsets[trees - 1] + nodes
    return trees, 0


@njit(cache=True, nogil=True)
def _read_tree(
    buf: np.ndarray,
    at: int,
    end: int,
    base: int,
    tokens: np.ndarray,
    parents: np.ndarray,
    sources: np.ndarray,
    scores: np.ndarray,
    counts: np.ndarray,
) -> tuple[int, int]:
    """The ``Tree`` message in ``buf[at:end]`` written from node ``base`` on (the arrays hold
    ``buf.size`` nodes): ``(nodes, error)``, error as :func:`decode_tree_batch` gives it."""
    cap = buf.size  # a node takes at least one byte of each field
    bits = np.empty(1, dtype=np.uint32)  # a little-endian float32's bits, read through ...
    as_float = bits.view(np.float32)  # ... this view
    counts[:] = 0
    while at < end:
        key, at = _varint(buf, at, end)
        if at < 0:
            return 0, 1
        f, wt = key >> 3, key & 7
        if f in (1, 2) and wt in (_VARINT, _LENGTH):  # tokens, parents: packed or one by one
            at, got = _read_int32s(buf, at, end, wt, tokens if f == 1 else parents, base + counts[f - 1], cap)
            if at < 0:
                return 0, 1
            counts[f - 1] = got - base
        elif f == 3 and wt == _LENGTH:  # sources: bytes, a singular field (the last one counts)
            m, at = _length(buf, at, end)
            if at < 0 or base + m > cap:
                return 0, 1
            for i in range(m):
                sources[base + i] = buf[at + i]
            counts[2] = m
            at += m
        elif f == 4 and wt in (_FIXED32, _LENGTH):  # scores: packed or one by one
            m = 4
            if wt == _LENGTH:
                m, at = _length(buf, at, end)
                if at < 0 or m % 4:
                    return 0, 1
            if at + m > end or base + counts[3] + m // 4 > cap:
                return 0, 1
            for i in range(m // 4):
                j = at + 4 * i
                bits[0] = (
                    np.uint32(buf[j])
                    | np.uint32(buf[j + 1]) << np.uint32(8)
                    | np.uint32(buf[j + 2]) << np.uint32(16)
                    | np.uint32(buf[j + 3]) << np.uint32(24)
                )
                scores[base + counts[3] + i] = as_float[0]
            counts[3] += m // 4
            at += m
        else:
            at = _skip(buf, at, end, wt)
            if at < 0:
                return 0, 1
    if at != end:
        return 0, 1
    n_nodes = counts[0]  # sources and scores are optional: all there or none
    if counts[1] != n_nodes or counts[2] not in (0, n_nodes) or counts[3] not in (0, n_nodes):
        return 0, 2
    if counts[2] == 0:
        sources[base : base + n_nodes] = 0
    if counts[3] == 0:
        scores[base : base + n_nodes] = 0.0
    return n_nodes, 0


@njit(cache=True, nogil=True)
def decode_prefetched_batch(
    buf: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Every ``Prefetched`` in field 2 of a serialized ``DraftResponse``: ``(per_item,
    path_tokens, path_ends, tokens, parents, sources, scores, offsets, error)``; item ``i``
    holds the next ``per_item[i]`` entries, entry ``e`` the accepted path ending at
    ``path_ends[e]`` and the tree of nodes ``[offsets[e], offsets[e + 1])``. ``error`` as
    :func:`decode_tree_batch` gives it."""
    size = cap = buf.size
    per_item = np.zeros(cap, dtype=np.int64)
    path_tokens = np.empty(cap, dtype=np.int32)
    path_ends = np.zeros(cap, dtype=np.int64)
    tokens = np.empty(cap, dtype=np.int32)
    parents = np.empty(cap, dtype=np.int32)
    sources = np.empty(cap, dtype=np.uint8)
    scores = np.empty(cap, dtype=np.float32)
    offsets = np.zeros(cap + 1, dtype=np.int64)
    counts = np.zeros(4, dtype=np.int64)
    items = entries = paths = error = 0
    at = 0
    while at < size:
        key, at = _varint(buf, at, size)
        if at < 0:
            break
        field, wire_type = key >> 3, key & 7
        if field != 2 or wire_type != _LENGTH:  # the trees, or a field this reader does not know
            at = _skip(buf, at, size, wire_type)
            if at < 0:
                break
            continue
        n, at = _length(buf, at, size)
        if at < 0:
            break
        item_end = at + n
        while 0 <= at < item_end:  # Prefetched: its items (field 1)
            key, at = _varint(buf, at, item_end)
            if at < 0:
                break
            if key != (1 << 3 | _LENGTH):
                at = _skip(buf, at, item_end, key & 7)
                continue
            m, at = _length(buf, at, item_end)
            if at < 0:
                break
            entry_end = at + m
            nodes = 0
            while 0 <= at < entry_end:  # Prefetch: accepted (1), tree (2)
                key, at = _varint(buf, at, entry_end)
                if at < 0:
                    break
                f, wt = key >> 3, key & 7
                if f == 1 and wt in (_VARINT, _LENGTH):
                    at, paths = _read_int32s(buf, at, entry_end, wt, path_tokens, paths, cap)
                elif f == 2 and wt == _LENGTH:  # the tree (the last one counts)
                    k, at = _length(buf, at, entry_end)
                    if at < 0:
                        break
                    nodes, error = _read_tree(
                        buf, at, at + k, offsets[entries], tokens, parents, sources, scores, counts
                    )
                    at = -1 if error else at + k
                else:
                    at = _skip(buf, at, entry_end, wt)
            if at != entry_end:
                at = -1
                break
            path_ends[entries] = paths
            offsets[entries + 1] = offsets[entries] + nodes
            entries += 1
            per_item[items] += 1
        if at != item_end:
            at = -1
            break
        items += 1
    if error or at != size:
        return per_item[:0], path_tokens[:0], path_ends[:0], tokens[:0], parents[:0], sources[:0], scores[:0], \
            offsets[:1], error if error else 1  # fmt: skip
    total = offsets[entries]
    return (
        per_item[:items], path_tokens[:paths], path_ends[:entries], tokens[:total], parents[:total],
        sources[:total], scores[:total], offsets[: entries + 1], 0,
    )  # fmt: skip


def _check(error: int) -> None:
    """A reader's error code (see :func:`decode_tree_batch`) as ``ValueError``."""
    if error:
        raise ValueError("malformed draft response" if error == 1 else "a draft tree's fields differ in length")


@njit(cache=True, nogil=True)
def malformed_trees(
    tokens: np.ndarray, parents: np.ndarray, offsets: np.ndarray, vocab_size: int, most_nodes: int
) -> np.ndarray:
    """Per tree (nodes ``[offsets[k], offsets[k + 1])``), whether it is one a decoder must not
    verify: a token outside ``[0, vocab_size)`` (``vocab_size`` 0: below 0 only), a parent not
    in ``[-1, i)`` for node ``i``, or more than ``most_nodes`` nodes (0: any number).

    >>> offsets = np.array([0, 2, 4, 6])
    >>> malformed_trees(np.array([5, 6, 5, 99, 5, 6]), np.array([-1, 0, -1, 0, -1, 1]), offsets, 50, 0).tolist()
    [False, True, True]
    """
    bad = np.zeros(offsets.size - 1, dtype=np.bool_)
    for k in range(offsets.size - 1):
        a, b = offsets[k], offsets[k + 1]
        if most_nodes and b - a > most_nodes:
            bad[k] = True
            continue
        for i in range(a, b):
            t, parent = tokens[i], parents[i]
            if t < 0 or (vocab_size and t >= vocab_size) or parent < -1 or parent >= i - a:
                bad[k] = True
                break
    return bad


def trees_from_response(resp: pb.DraftResponse) -> list[DraftTree]:
    """The response's trees, read in one compiled pass over its bytes (its prefetched trees are
    left out); ``ValueError`` if a tree's fields disagree."""
    buf = np.frombuffer(resp.SerializeToString(), dtype=np.uint8)
    tokens, parents, sources, scores, offsets, error = decode_tree_batch(buf)
    _check(error)
    ends = offsets.tolist()
    return [DraftTree(tokens[a:b], parents[a:b], sources[a:b], scores[a:b]) for a, b in itertools.pairwise(ends)]


def checked_trees_from_response(
    resp: pb.DraftResponse, vocab_size: int, most_nodes: int
) -> tuple[list[DraftTree], list[bool]]:
    """:func:`trees_from_response`, and per tree whether it is malformed (see
    :func:`malformed_trees`); a malformed tree comes back empty."""
    buf = np.frombuffer(resp.SerializeToString(), dtype=np.uint8)
    tokens, parents, sources, scores, offsets, error = decode_tree_batch(buf)
    _check(error)
    bad = malformed_trees(tokens, parents, offsets, vocab_size, most_nodes).tolist()
    ends = offsets.tolist()
    trees = [
        _EMPTY if b else DraftTree(tokens[a:e], parents[a:e], sources[a:e], scores[a:e])
        for (a, e), b in zip(itertools.pairwise(ends), bad, strict=True)
    ]
    return trees, bad


def prefetched_from_response(
    resp: pb.DraftResponse, vocab_size: int | None = None
) -> list[dict[tuple[int, ...], DraftTree]]:
    """Per item, the trees drafted ahead by accepted path, read in one compiled pass over the
    response's bytes; ``ValueError`` if they are malformed. With ``vocab_size`` (0: not known),
    a tree with an id outside ``[0, vocab_size)`` or a parent that is not an earlier node is left
    out (see :func:`malformed_trees`)."""
    buf = np.frombuffer(resp.SerializeToString(), dtype=np.uint8)
    per_item, path_tokens, path_ends, tokens, parents, sources, scores, offsets, error = decode_prefetched_batch(buf)
    _check(error)
    if vocab_size is None:
        bad = [False] * (offsets.size - 1)
    else:
        bad = malformed_trees(tokens, parents, offsets, vocab_size, 0).tolist()
    paths, ends, nodes = path_tokens.tolist(), path_ends.tolist(), offsets.tolist()
    out: list[dict[tuple[int, ...], DraftTree]] = []
    e = start = 0
    for count in per_item.tolist():
        ahead = {}
        for _ in range(count):
            a, b = nodes[e], nodes[e + 1]
            if not bad[e]:
                ahead[tuple(paths[start : ends[e]])] = DraftTree(tokens[a:b], parents[a:b], sources[a:b], scores[a:b])
            start = ends[e]
            e += 1
        out.append(ahead)
    return out


def tree_from_proto(msg: pb.Tree) -> DraftTree:
    """A wire tree as the domain type, field by field: the slow way (about 20 us a tree) that
    :func:`trees_from_response` replaces, for a single tree or a reference to compare against."""
    return DraftTree(
        np.array(msg.tokens, dtype=np.int32),
        np.array(msg.parents, dtype=np.int32),
        np.frombuffer(msg.sources, dtype=np.uint8).copy(),
        np.array(msg.scores, dtype=np.float32),
    )


def warm_up() -> None:
    """Compile (or load from cache) the readers now, not on a first response; and the cut of a
    tree drafted ahead to the subtree an outcome selects."""
    one = pb.Tree(tokens=[1], parents=[-1], sources=b"\x01", scores=[0.5])
    resp = pb.DraftResponse(trees=[one], prefetched=[pb.Prefetched(items=[pb.Prefetch(accepted=[2], tree=one)])])
    (tree,) = trees_from_response(resp)
    checked_trees_from_response(resp, 2, 1)
    (ahead,) = prefetched_from_response(resp, 2)
    for t in (tree, *ahead.values()):
        subtree(t, 1)

"""The decoder's compiled reader of draft trees against protobuf's own parser."""

import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from google.protobuf.message import DecodeError

from decoder_client.client import tree_from_proto
from decoder_client.wire import (
    decode_prefetched_batch,
    decode_tree_batch,
    prefetched_from_response,
    trees_from_response,
)


def _tree(rng: np.random.Generator, n: int) -> pb.Tree:
    return pb.Tree(
        tokens=rng.integers(0, 2**31 - 1, size=n).tolist(),
        parents=rng.integers(-1, max(n, 1), size=n).tolist(),
        sources=bytes(rng.integers(0, 7, size=n).astype(np.uint8)),
        scores=rng.random(n).astype(np.float32).tolist(),
    )


def _same(got, want) -> None:  # type: ignore[no-untyped-def]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for name in ("tokens", "parents", "sources", "scores"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), name


@pytest.mark.parametrize("seed", range(5))
def test_trees_read_from_the_wire_equal_protobufs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    trees = [_tree(rng, int(rng.integers(0, 70))) for _ in range(int(rng.integers(0, 40)))]
    ahead = pb.Prefetched(items=[pb.Prefetch(accepted=[1, 2], tree=_tree(rng, 3))])
    resp = pb.DraftResponse(trees=trees, prefetched=[ahead])  # field 2 is left for protobuf
    _same(trees_from_response(resp), [tree_from_proto(t) for t in resp.trees])


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes([*out, v])


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def test_unpacked_fields_and_unknown_fields_read_as_protobuf_reads_them() -> None:
    tokens, parents, scores = [7, 300, 2**31 - 1], [-1, 0, 1], [0.5, 0.25, 1.0]
    body = b"".join(_field(1, 0, _varint(t)) for t in tokens)  # tokens one by one
    body += _field(2, 2, _varint(len(b := b"".join(_varint(p) for p in parents))) + b)
    body += _field(9, 0, _varint(12345))  # fields this reader does not know
    body += _field(10, 2, _varint(3) + b"abc") + _field(11, 1, bytes(8)) + _field(12, 5, bytes(4))
    body += _field(3, 2, _varint(2) + bytes([9, 9]))  # sources is bytes: the last occurrence counts
    body += _field(3, 2, _varint(3) + bytes([1, 2, 3]))
    body += b"".join(_field(4, 5, np.float32(s).tobytes()) for s in scores)  # scores one by one
    raw = _field(1, 2, _varint(len(body)) + body) + _field(7, 0, _varint(1)) + _field(1, 2, _varint(0))
    resp = pb.DraftResponse.FromString(raw)
    buf = np.frombuffer(raw, dtype=np.uint8)
    got = decode_tree_batch(buf)
    assert got[-1] == 0 and got[4].tolist() == [0, 3, 3]
    assert got[0].tolist() == tokens and got[1].tolist() == parents and got[3].tolist() == scores
    _same(trees_from_response(resp), [tree_from_proto(t) for t in resp.trees])


def test_cut_or_damaged_bytes_are_refused_where_protobuf_refuses_them() -> None:
    rng = np.random.default_rng(9)
    raw = pb.DraftResponse(trees=[_tree(rng, 5), _tree(rng, 0), _tree(rng, 9)]).SerializeToString()
    damaged = [raw[:cut] for cut in range(len(raw))]
    damaged += [raw[:i] + bytes([rng.integers(0, 256)]) + raw[i + 1 :] for i in range(len(raw))]
    for data in damaged:
        got = decode_tree_batch(np.frombuffer(data, dtype=np.uint8))
        try:
            want = pb.DraftResponse.FromString(data)
        except DecodeError:
            assert got[-1] != 0  # refused
            continue
        if got[-1] == 0:
            trees = [(got[0][a:b].tolist(), got[1][a:b].tolist()) for a, b in zip(got[4], got[4][1:], strict=False)]
            assert trees == [(list(t.tokens), list(t.parents)) for t in want.trees]
        else:  # protobuf parses it, but a tree's fields no longer line up
            assert got[-1] == 2 and any(
                not len(t.tokens) == len(t.parents) == len(t.sources) == len(t.scores) for t in want.trees
            )


def test_sources_and_scores_are_optional() -> None:
    (tree,) = trees_from_response(pb.DraftResponse(trees=[pb.Tree(tokens=[4, 5], parents=[-1, 0])]))
    assert tree.tokens.tolist() == [4, 5] and tree.sources.tolist() == [0, 0] and tree.scores.tolist() == [0, 0]


def test_a_tree_whose_fields_disagree_is_an_error() -> None:
    resp = pb.DraftResponse(trees=[pb.Tree(tokens=[1, 2], parents=[-1], sources=b"\x00\x00", scores=[1.0, 1.0])])
    with pytest.raises(ValueError, match="differ in length"):
        trees_from_response(resp)


def _ahead_by_protobuf(resp: pb.DraftResponse) -> list[dict[tuple[int, ...], object]]:
    return [{tuple(p.accepted): tree_from_proto(p.tree) for p in more.items} for more in resp.prefetched]


@pytest.mark.parametrize("seed", range(5))
def test_trees_drafted_ahead_read_from_the_wire_equal_protobufs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    prefetched = []
    for _ in range(int(rng.integers(0, 12))):  # per item: none, or trees under distinct paths (the empty one too)
        paths = {tuple(rng.integers(-(2**31), 2**31 - 1, size=int(rng.integers(0, 4))).tolist()) for _ in range(3)}
        items = [pb.Prefetch(accepted=list(p), tree=_tree(rng, int(rng.integers(0, 30)))) for p in paths]
        if rng.random() < 0.2:
            items.append(pb.Prefetch(accepted=[5]))  # no tree set: an empty one
        prefetched.append(pb.Prefetched(items=items))
    resp = pb.DraftResponse(trees=[_tree(rng, 4)], prefetched=prefetched)
    got, want = prefetched_from_response(resp), _ahead_by_protobuf(resp)
    assert [list(a) for a in got] == [list(b) for b in want]  # the same paths, in order
    for a, b in zip(got, want, strict=True):
        _same(list(a.values()), list(b.values()))


def test_unpacked_accepted_paths_and_unknown_fields_read_as_protobuf_reads_them() -> None:
    tree = _tree(np.random.default_rng(3), 5).SerializeToString()
    entry = b"".join(_field(1, 0, _varint(t)) for t in (4, -7))  # the path one token at a time
    entry += _field(9, 2, _varint(2) + b"zz") + _field(2, 2, _varint(len(tree)) + tree)
    item = _field(1, 2, _varint(len(entry)) + entry) + _field(6, 0, _varint(3))
    raw = _field(2, 2, _varint(len(item)) + item) + _field(2, 2, _varint(0)) + _field(8, 5, bytes(4))
    resp = pb.DraftResponse.FromString(raw)
    got = prefetched_from_response(resp)
    assert [list(a) for a in got] == [[(4, -7)], []]
    _same(list(got[0].values()), list(_ahead_by_protobuf(resp)[0].values()))


def test_damaged_prefetched_bytes_are_refused() -> None:
    rng = np.random.default_rng(4)
    resp = pb.DraftResponse(prefetched=[pb.Prefetched(items=[pb.Prefetch(accepted=[1, 2], tree=_tree(rng, 6))])])
    raw = resp.SerializeToString()
    for cut in range(1, len(raw)):
        # Protobuf refuses every cut of this message; so does the reader.
        with pytest.raises(DecodeError):
            pb.DraftResponse.FromString(raw[:cut])
        assert decode_prefetched_batch(np.frombuffer(raw[:cut], dtype=np.uint8))[-1] != 0

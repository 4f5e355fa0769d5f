"""The compiled tree encoder writes exactly the bytes protobuf writes for the same trees."""

from __future__ import annotations

import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.domain.items import Drafted
from cache_service.rpc import convert
from cache_service.rpc.wire import Encoded, encode_prefetched, encode_trees, serializer, stream_draft
from indexer.tree_builder import DraftTree, TreeBatch, whole_batch

INT32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def trees(draw):
    n = draw(st.integers(0, 40))
    ints = st.lists(INT32, min_size=n, max_size=n)
    tokens = np.array(draw(ints), dtype=np.int32)
    parents = np.array(draw(ints), dtype=np.int32)
    sources = np.array(draw(st.lists(st.integers(0, 255), min_size=n, max_size=n)), dtype=np.uint8)
    scores = np.array(draw(st.lists(st.floats(width=32, allow_nan=False), min_size=n, max_size=n)), dtype=np.float32)
    return DraftTree(tokens, parents, sources, scores)


def _reference(batch: list[DraftTree]) -> bytes:
    return pb.DraftResponse(trees=[convert.tree(t) for t in batch]).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(batch=st.lists(trees(), max_size=12))
def test_bytes_equal_protobufs_own(batch):
    # Any int32 (negative ids take ten bytes), empty trees (an empty submessage), any float bits.
    assert encode_trees(batch) == _reference(batch)


@st.composite
def drafted_ahead(draw):
    """Per item, trees drafted ahead keyed by accepted paths (the empty path too), or none."""
    items = []
    for _ in range(draw(st.integers(0, 6))):
        paths = draw(st.lists(st.lists(INT32, max_size=5).map(tuple), max_size=4, unique=True))
        items.append({path: draw(trees()) for path in paths})
    return items


@settings(max_examples=300, deadline=None)
@given(batch=st.lists(trees(), max_size=6), ahead=drafted_ahead())
def test_trees_drafted_ahead_are_written_as_protobuf_writes_them(batch, ahead):
    want = pb.DraftResponse(
        trees=[convert.tree(t) for t in batch],
        prefetched=[
            pb.Prefetched(items=[pb.Prefetch(accepted=list(p), tree=convert.tree(t)) for p, t in a.items()])
            for a in ahead
        ],
    )
    assert encode_trees(batch) + encode_prefetched(ahead) == want.SerializeToString()


def test_varint_boundaries():
    edges = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**31 - 1, -1, -128, -(2**31)]
    tree = DraftTree(
        np.array(edges, dtype=np.int32),
        np.array(edges[::-1], dtype=np.int32),
        np.arange(len(edges), dtype=np.uint8),
        np.linspace(0, 1, len(edges), dtype=np.float32),
    )
    assert encode_trees([tree, DraftTree.empty(), tree]) == _reference([tree, DraftTree.empty(), tree])


def test_draft_response_parses_back_to_the_same_trees():
    a = DraftTree.chain(np.array([5, 6, 7], dtype=np.int32))
    b = DraftTree(
        np.array([9, 4], dtype=np.int32),
        np.array([-1, -1], dtype=np.int32),
        np.array([3, 1], dtype=np.uint8),
        np.array([0.5, 0.25], dtype=np.float32),
    )
    encoded = convert.draft_response(Drafted([a, DraftTree.empty(), b]))
    assert isinstance(encoded, Encoded)  # sent as it is
    resp = pb.DraftResponse.FromString(encoded.data)
    assert [list(t.tokens) for t in resp.trees] == [[5, 6, 7], [], [9, 4]]
    assert [list(t.parents) for t in resp.trees] == [[-1, 0, 1], [], [-1, -1]]
    assert resp.trees[2].sources == b"\x03\x01" and list(resp.trees[2].scores) == [0.5, 0.25]
    assert len(resp.prefetched) == 0


def test_draft_response_with_trees_drafted_ahead():
    a, ahead = DraftTree.chain(np.array([5, 6], dtype=np.int32)), DraftTree.chain(np.array([8], dtype=np.int32))
    resp = pb.DraftResponse.FromString(convert.draft_response(Drafted([a, a], [{(5,): ahead}, {}])).data)
    assert [list(t.tokens) for t in resp.trees] == [[5, 6], [5, 6]]
    assert [[(list(p.accepted), list(p.tree.tokens)) for p in f.items] for f in resp.prefetched] == [[([5], [8])], []]


@settings(max_examples=200, deadline=None)
@given(request_id=st.integers(0, 2**64 - 1), batch=st.lists(trees(), max_size=4))
def test_stream_draft_bytes_equal_protobufs_own(request_id, batch):
    draft = encode_trees(batch)
    expected = pb.StreamResponse(request_id=request_id, draft=pb.DraftResponse.FromString(draft))
    assert stream_draft(request_id, draft).data == expected.SerializeToString()


def test_serializer_sends_encoded_responses_unchanged():
    write = serializer(pb.EchoResponse.SerializeToString)
    assert write is not None and serializer(None) is None
    assert write(Encoded(b"\x0a\x01z")) == b"\x0a\x01z"
    assert write(pb.EchoResponse(payload=b"z")) == b"\x0a\x01z"


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(trees(), min_size=1, max_size=6))
def test_a_whole_draft_batch_is_written_from_its_arrays(batch):
    # Trees drafted together lie end to end in one batch; written from there or joined, and in
    # any order or selection, the bytes are protobuf's.
    offsets = np.cumsum([0] + [len(t) for t in batch], dtype=np.int64)
    arrays = [np.concatenate([getattr(t, f) for t in batch]) for f in ("tokens", "parents", "sources", "scores")]
    stored = TreeBatch(*arrays, offsets)
    views = [DraftTree(*(a[offsets[j] : offsets[j + 1]] for a in arrays), stored, j) for j in range(len(batch))]
    assert whole_batch(views) is stored and whole_batch(views[::-1]) is (stored if len(views) == 1 else None)
    assert encode_trees(views) == _reference(batch)
    assert encode_trees(views[::-1]) == _reference(batch[::-1])
    assert encode_trees(views[1:]) == _reference(batch[1:])

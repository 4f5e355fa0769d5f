"""Reading a namespace's static prior over gRPC (ReadPrior), what a decoder's near copy drafts
with when no prior file is shipped beside it: in pages, checked against the stored digest, every
boundary checked before storage is asked; and a near copy that takes the published prior, and a
newer one once it is published. A real service on a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.app import connect
from cache_service.domain.service import MAX_PRIOR_PAGE_BYTES
from cache_service.storage.redis_store import RedisStore
from decoder_client.client.config import ClientConfig
from decoder_client.client.near import NearClient
from decoder_client.client.prior_follow import PageRead, PriorChanged, read_blob
from indexer.drafter import DraftParams
from indexer.prior import PriorConfig, StaticPrior, blob_digest
from tests.service.authed_replicas import md, tenants_replica
from tests.service.conftest import Replica, eventually, replica_with_namespace

NS = "toy"
VOCAB = 100


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Replica, RedisStore]]:
    with replica_with_namespace(tmp_path, NS, VOCAB) as (r, url):
        yield r, RedisStore(connect(url))


def prior_of(tokens: list[int]) -> StaticPrior:
    return StaticPrior.build(np.array(tokens, dtype=np.int32), PriorConfig(orders=(1, 2)))


def page(r: Replica, version: int, offset: int, max_bytes: int, ns: str = NS) -> pb.ReadPriorResponse:
    return r.stub.ReadPrior(pb.ReadPriorRequest(namespace=ns, version=version, offset=offset, max_bytes=max_bytes))


def reader(r: Replica) -> PageRead:
    def read(version: int, offset: int, max_bytes: int) -> tuple[int, int, str, bytes]:
        resp = page(r, version, offset, max_bytes)
        return resp.version, resp.size, resp.digest, resp.data

    return read


def test_the_published_prior_is_read_in_pages_and_checked(served: tuple[Replica, RedisStore]) -> None:
    replica, store = served
    none = page(replica, 0, 0, 1000)
    assert (none.version, none.size, none.digest, none.data) == (0, 0, "", b"")
    assert read_blob(reader(replica), known=0) is None  # nothing published: nothing to read
    blob = prior_of([40, 41, 42, 43] * 50).to_bytes()
    version = store.put_prior(NS, blob)
    first = page(replica, 0, 0, 100)  # the current version, from its start
    assert (first.version, first.size, first.digest, first.data) == (version, len(blob), blob_digest(blob), blob[:100])
    assert page(replica, version, 100, 50).data == blob[100:150]
    assert page(replica, version, len(blob) - 3, 50).data == blob[-3:]
    assert page(replica, version, len(blob), 50).data == b""
    # Reassembled in pages of 64 bytes, checked against the digest; none again at that version.
    got = read_blob(reader(replica), known=0, page_bytes=64)
    assert got == (version, blob)
    assert read_blob(reader(replica), known=version) is None
    assert StaticPrior.from_bytes(got[1]).lookup(np.array([41], dtype=np.int32)) is not None


def test_a_version_gone_under_a_reader_is_told(served: tuple[Replica, RedisStore]) -> None:
    replica, store = served
    old = store.put_prior(NS, prior_of([1, 2, 3, 4] * 40).to_bytes())
    calls = []

    def read_then_publish_twice(version: int, offset: int, max_bytes: int) -> tuple[int, int, str, bytes]:
        calls.append(version)
        if len(calls) == 2:  # between the first page and the second, two publishes drop it
            store.put_prior(NS, prior_of([5, 6, 7, 8] * 40).to_bytes())
            store.put_prior(NS, prior_of([9, 10, 11, 12] * 40).to_bytes())
        return reader(replica)(version, offset, max_bytes)

    with pytest.raises(PriorChanged, match="went while it was read"):
        read_blob(read_then_publish_twice, known=0, page_bytes=64)
    assert calls == [0, old]
    with pytest.raises(grpc.RpcError) as err:
        page(replica, old, 0, 10)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("ns", "version", "offset", "max_bytes", "code"),
    [
        (NS, 0, 0, 0, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, 0, 0, MAX_PRIOR_PAGE_BYTES + 1, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, 0, 10, 100, grpc.StatusCode.INVALID_ARGUMENT),  # an offset names its version
        (NS, 1, 1 << 40, 100, grpc.StatusCode.INVALID_ARGUMENT),  # past the prior's end
        (NS, 99, 0, 100, grpc.StatusCode.NOT_FOUND),  # no such version
        ("", 0, 0, 100, grpc.StatusCode.INVALID_ARGUMENT),
        ("unknown", 0, 0, 100, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_a_bad_read_is_refused(
    served: tuple[Replica, RedisStore], ns: str, version: int, offset: int, max_bytes: int, code: grpc.StatusCode
) -> None:
    replica, store = served
    assert store.put_prior(NS, prior_of([1, 2, 3] * 10).to_bytes()) == 1
    with pytest.raises(grpc.RpcError) as err:
        page(replica, version, offset, max_bytes, ns)
    assert err.value.code() is code


def test_a_tenant_reads_only_its_own_namespaces_prior(tmp_path: Path) -> None:
    with tenants_replica(tmp_path, VOCAB) as replica:

        def read(ns: str, token: str | None) -> pb.ReadPriorResponse:
            req = pb.ReadPriorRequest(namespace=ns, max_bytes=10)
            return replica.stub.ReadPrior(req, metadata=md(token) if token else None)

        assert read("ns-a", "tok-a").version == 0
        for ns, token, code in (
            ("ns-b", "tok-a", grpc.StatusCode.PERMISSION_DENIED),
            ("ns-a", None, grpc.StatusCode.UNAUTHENTICATED),
        ):
            with pytest.raises(grpc.RpcError) as err:
                read(ns, token)
            assert err.value.code() is code


def test_a_near_copy_drafts_with_the_published_prior_and_takes_a_newer_one(
    served: tuple[Replica, RedisStore],
) -> None:
    replica, store = served
    first = store.put_prior(NS, prior_of([40, 41, 42, 43, 44, 45] * 20).to_bytes())
    config = ClientConfig(target=replica.target, namespace=NS, params=DraftParams(chain=4))
    near = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0, start_s=10.0, prior_check_s=0.1)
    without = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0, start_s=10.0)  # prior_check_s 0
    try:
        # Read before the first request: its first draft comes from the prior.
        assert near.stats.prior_version == first
        (s,) = near.open([[7, 8, 40, 41]])
        assert near.draft([s], [[]])[0].tokens.tolist()[:2] == [42, 43]
        (t,) = without.open([[7, 8, 40, 41]])
        assert without.draft([t], [[]])[0].tokens.tolist()[:2] != [42, 43]
        assert without.stats.prior_version == 0 and without.prior_follower is None
        # A newer version published: the near copy takes it from its next look.
        second = store.put_prior(NS, prior_of([40, 41, 60, 61, 62, 63] * 20).to_bytes())
        eventually(lambda: near.stats.prior_version == second)
        (u,) = near.open([[7, 8, 40, 41]])
        assert near.draft([u], [[]])[0].tokens.tolist()[:2] == [60, 61]
    finally:
        near.shutdown()
        without.shutdown()


def test_a_near_copy_refuses_a_published_prior_outside_the_vocabulary(served: tuple[Replica, RedisStore]) -> None:
    """A prior of another tokenizer published for the namespace: the near copy keeps drafting
    with the one it had, and never proposes an id outside the vocabulary."""
    replica, store = served
    first = store.put_prior(NS, prior_of([40, 41, 42, 43, 44, 45] * 20).to_bytes())
    config = ClientConfig(target=replica.target, namespace=NS, params=DraftParams(chain=4))
    near = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0, start_s=10.0, prior_check_s=0.1)
    try:
        assert near.stats.prior_version == first
        bad = store.put_prior(NS, prior_of([40, 41, 142, 143, 144, 145] * 20).to_bytes())
        assert near.prior_follower is not None
        eventually(lambda: near.prior_follower is not None and near.prior_follower.version == bad)
        assert near.stats.prior_version == first  # refused: the first one drafts on
        (s,) = near.open([[7, 8, 40, 41]])
        assert near.draft([s], [[]])[0].tokens.tolist()[:2] == [42, 43]
    finally:
        near.shutdown()


def test_a_near_copy_whose_service_is_down_starts_without_the_prior() -> None:
    config = ClientConfig(target="127.0.0.1:1", namespace=NS, params=DraftParams(chain=4), control_timeout_s=0.5)
    near = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0, start_s=2.0, prior_check_s=0.1)
    try:
        assert near.stats.prior_version == 0 and near.drafter.prior is None
        (s,) = near.open([[5, 6, 7, 8, 5, 6]])
        assert near.draft([s], [[]])[0].tokens.tolist()[:2] == [7, 8]  # its own context still drafts
    finally:
        near.shutdown()

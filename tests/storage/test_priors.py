"""Prior blobs: chunked, checksummed, versioned with one previous version kept."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cache_service.storage import RedisStore, StorageCorrupt, StorageUnavailable, StoreConfig, keys, priors
from cache_service.storage.clients import StorageClient
from cache_service.storage.redis_store import MiB
from indexer.prior import PriorConfig, StaticPrior


def _prior_keys(client: StorageClient, ns: str, version: int) -> list[bytes]:
    return sorted(client.scan_iter(match=f"draftcache:v1:ns:{{{ns}}}:prior:{version}:*", count=1000))


def test_missing_prior_is_none(store: RedisStore) -> None:
    assert store.get_prior("ns") is None
    assert store.prior_version("ns") is None
    assert store.rollback_prior("ns") is None


def test_large_blob_is_chunked_and_verified(store: RedisStore, client: StorageClient) -> None:
    blob = os.urandom(20 * MiB + 12345)  # parts of 1 MiB (the fixture's config): 21 parts
    version = store.put_prior("ns", blob)
    assert store.prior_version("ns") == version
    got = store.get_prior("ns")
    assert got is not None and got[0] == version and got[1] == blob
    parts = [k for k in _prior_keys(client, "ns", version) if not k.endswith(b":meta")]
    assert len(parts) == 21
    assert client.strlen(keys.prior_part("ns", version, 20)) == 12345
    assert all(client.ttl(k) == -1 for k in _prior_keys(client, "ns", version))  # published: permanent


def test_a_range_is_read_across_parts_and_a_gone_version_reads_none(store: RedisStore) -> None:
    blob = os.urandom(3 * MiB + 777)  # parts of 1 MiB: 4 parts, the last 777 bytes
    version = store.put_prior("ns", blob)
    pages = []
    for offset in range(0, len(blob), 700_001):  # pages that straddle parts
        found = store.get_prior_range("ns", version, offset, 700_001)
        assert found is not None
        meta, page = found
        assert (meta.size, meta.digest) == (len(blob), priors.PriorMeta.describe(blob, part_size=MiB).digest)
        pages.append(page)
    assert b"".join(pages) == blob
    assert store.get_prior_range("ns", version, MiB - 1, 2)[1] == blob[MiB - 1 : MiB + 1]  # type: ignore[index]
    assert store.get_prior_range("ns", version, len(blob), 10)[1] == b""  # type: ignore[index]
    assert store.get_prior_range("ns", version, len(blob) - 5, 10)[1] == blob[-5:]  # type: ignore[index]
    store.put_prior("ns", b"second")
    store.put_prior("ns", b"third")  # two publishes later the first version is gone
    assert store.get_prior_range("ns", version, 0, 10) is None
    assert store.get_prior_range("other", 1, 0, 10) is None


def test_a_real_static_prior_round_trips(store: RedisStore) -> None:
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 9, 4, 2, 5] * 20, dtype=np.int32)
    prior = StaticPrior.build(tokens, PriorConfig(orders=(1, 2), follower_len=2))
    store.put_prior("llama2", prior.to_bytes())
    got = store.get_prior("llama2")
    assert got is not None
    loaded = StaticPrior.from_bytes(bytes(got[1]))
    context = np.array([7, 1, 2], np.int32)
    assert loaded.lookup(context).rows.tolist() == prior.lookup(context).rows.tolist()  # type: ignore[union-attr]


def test_versions_switch_keep_one_previous_and_roll_back(store: RedisStore, client: StorageClient) -> None:
    v1, v2, v3 = (store.put_prior("ns", bytes([i]) * 100) for i in range(1, 4))
    assert v1 < v2 < v3 and store.prior_version("ns") == v3
    assert _prior_keys(client, "ns", v1) == []  # two publishes old: deleted
    assert _prior_keys(client, "ns", v2) != []  # kept for rollback
    assert store.rollback_prior("ns") == v2
    got = store.get_prior("ns")
    assert got is not None and got == (v2, bytes([2]) * 100)
    assert store.rollback_prior("ns") == v3  # and forward again
    store.put_prior("other", b"x")  # namespaces are independent
    assert store.prior_version("ns") == v3


def test_corrupt_or_missing_parts_are_reported(store: RedisStore, client: StorageClient) -> None:
    version = store.put_prior("ns", os.urandom(3 * MiB))
    part = keys.prior_part("ns", version, 1)
    original = client.get(part)
    assert original is not None
    client.set(part, original[:-1] + bytes([original[-1] ^ 1]))  # one flipped bit
    with pytest.raises(StorageCorrupt, match="checksum"):
        store.get_prior("ns")
    client.set(part, original[:-1])  # a short part
    with pytest.raises(StorageCorrupt, match="part 1"):
        store.get_prior("ns")
    client.delete(part)
    with pytest.raises(StorageCorrupt, match="incomplete"):
        store.get_prior("ns")
    client.hset(keys.prior_meta("ns", version), "parts", "x")
    with pytest.raises(StorageCorrupt, match="metadata"):
        store.get_prior("ns")
    client.set(keys.prior_current("ns"), b"v?")
    with pytest.raises(StorageCorrupt):
        store.prior_version("ns")


def test_staged_parts_expire_and_an_expired_upload_is_not_published(store: RedisStore, client: StorageClient) -> None:
    old = store.put_prior("ns", b"old")
    version, meta = priors.stage(client, "ns", b"new" * 1000, part_size=1 << 10, ttl_s=60)
    staged = _prior_keys(client, "ns", version)
    assert len(staged) == meta.parts + 1 == 4
    assert all(0 < client.ttl(k) <= 60 for k in staged)  # a writer that dies leaves nothing for long
    client.delete(keys.prior_part("ns", version, 2))  # as if that part's TTL ran out
    with pytest.raises(StorageUnavailable, match="expired"):
        priors.publish(client, "ns", version, meta.parts)
    assert store.prior_version("ns") == old


def test_empty_blob_and_bad_config_are_refused(store: RedisStore) -> None:
    with pytest.raises(ValueError):
        store.put_prior("ns", b"")
    with pytest.raises(ValueError):
        StoreConfig(prior_part_bytes=1024 * MiB)  # over Redis' 512 MB proto-max-bulk-len


@pytest.mark.slow
def test_a_200_mb_prior_with_default_64_mb_parts(client: StorageClient) -> None:
    store = RedisStore(client, StoreConfig())
    blob = np.random.default_rng(0).integers(0, 256, 200 * MiB, dtype=np.uint8).tobytes()
    version = store.put_prior("big", blob)
    assert client.hget(keys.prior_meta("big", version), "parts") == b"4"
    got = store.get_prior("big")
    assert got is not None and got[1] == blob

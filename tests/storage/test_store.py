"""Namespace registry, health and client requirements."""

from __future__ import annotations

import numpy as np
import pytest

from cache_service.storage import NamespaceConflict, RedisStore, StorageCorrupt, StoreConfig, keys
from cache_service.storage.clients import StorageClient
from cache_service.storage.connect import connect
from tests.storage.conftest import stored


def test_register_and_list_namespaces(store: RedisStore) -> None:
    assert store.namespaces() == {}
    assert store.register_namespace("acme/llama2", 32000)
    assert store.register_namespace("smollm2", 49152)
    assert not store.register_namespace("smollm2", 49152)  # idempotent
    assert store.namespaces() == {"acme/llama2": 32000, "smollm2": 49152}


def test_a_namespace_keeps_its_vocabulary(store: RedisStore) -> None:
    store.register_namespace("n", 100)
    with pytest.raises(NamespaceConflict, match="100"):
        store.register_namespace("n", 101)
    with pytest.raises(ValueError):
        store.register_namespace("m", 0)
    with pytest.raises(ValueError):
        store.register_namespace("bad name", 10)
    assert store.namespaces() == {"n": 100}


def test_the_first_tokenizer_claimed_stays_until_the_namespace_is_deleted(store: RedisStore) -> None:
    a, b = "0123456789abcdef", "fedcba9876543210"
    store.register_namespace("n", 100)
    store.register_namespace("m", 100)
    assert store.tokenizers(["n", "m"]) == {"n": "", "m": ""}  # none claimed
    assert store.claim_tokenizer("n", a) == a
    assert store.claim_tokenizer("n", b) == a  # the first claim wins; nothing overwritten
    assert store.tokenizers(["n", "m"]) == {"n": a, "m": ""}
    store.delete_namespace("n")
    assert store.tokenizers(["n"]) == {"n": ""}  # deleted with the namespace's keys
    assert store.claim_tokenizer("n", b) == b
    for bad in ("ABCDEF0123456789", "0123", "not a fingerprint"):
        with pytest.raises(ValueError):
            store.claim_tokenizer("m", bad)
    assert store.tokenizers(["m"]) == {"m": ""}


def test_a_mangled_tokenizer_fingerprint_is_corrupt(store: RedisStore, client: StorageClient) -> None:
    client.set(keys.tokenizer("n"), "many")
    with pytest.raises(StorageCorrupt):
        store.tokenizers(["n"])
    with pytest.raises(StorageCorrupt):
        store.claim_tokenizer("n", "0123456789abcdef")


def test_a_mangled_registry_is_corrupt(store: RedisStore, client: StorageClient) -> None:
    client.hset(keys.NAMESPACES, "n", "many")
    with pytest.raises(StorageCorrupt):
        store.namespaces()


def test_ping_measures_a_round_trip(store: RedisStore) -> None:
    assert 0 < store.ping() < 1


def test_a_decoding_client_is_refused(backend_url: str) -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        RedisStore(connect(backend_url, decode_responses=True))


@pytest.mark.parametrize(
    "kwargs", [{"max_log_tokens": 0}, {"prior_part_bytes": 0}, {"prior_staging_ttl_s": 0}, {"read_batch": 0}]
)
def test_config_is_validated(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        StoreConfig(**kwargs)


def test_a_resp3_client_reads_the_same(backend_url: str, store: RedisStore) -> None:
    resp3 = RedisStore(connect(backend_url, protocol=3))
    ids = resp3.append_requests("n", [np.array([1, 2], np.int32)])
    assert [e.id for e in store.read_log("n")] == ids
    assert [e.tokens.tolist() for e in resp3.follow("n", "0", block_ms=10)] == [[1, 2]]
    assert resp3.follow("n", ids[-1], block_ms=10) == []
    assert resp3.register_namespace("n", 7) and store.namespaces() == resp3.namespaces() == {"n": 7}
    resp3.save_session("s", stored([1, 2], 1, [((1,), [((2,), 1)])]), ttl_s=10)
    loaded = resp3.load_session("s")
    assert loaded is not None and loaded.snapshot.rejected.items() == [((1,), [((2,), 1)])]
    version = resp3.put_prior("n", b"abc")
    assert resp3.get_prior("n") == (version, b"abc")
    assert resp3.session_ids() == ["s"]

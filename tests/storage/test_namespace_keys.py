"""Deleting a namespace from storage, on one Redis and on a cluster: every key of it goes, and
nothing of any other namespace."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cache_service.storage import RedisStore, keys
from cache_service.storage.clients import StorageClient
from tests.storage.conftest import stored


def _keys(client: StorageClient, pattern: str) -> set[bytes]:
    return set(client.scan_iter(match=pattern, count=100))


def test_a_deleted_namespace_leaves_no_key_and_others_keep_theirs(store: RedisStore, client: StorageClient) -> None:
    for ns in ("gone", "kept"):
        store.register_namespace(ns, 100)
        store.append_requests(ns, [np.arange(5, dtype=np.int32)])
        store.log_identity(ns)
        for blob in (b"first prior", b"second prior", b"third prior"):  # current, previous, and a seq
            store.put_prior(ns, blob)
    sessions = {f"sess-{ns}-{j}": ns for ns in ("gone", "kept") for j in range(30)}
    store.save_sessions([(sid, replace(stored([1, 2, 3], 1), namespace=ns)) for sid, ns in sessions.items()], 60)
    assert _keys(client, keys.namespace_pattern("gone"))

    deleted = store.delete_namespace("gone")

    assert deleted.registered and deleted.sessions == 30 and deleted.keys >= 8
    assert _keys(client, keys.namespace_pattern("gone")) == set()
    assert store.namespaces() == {"kept": 100}
    assert store.session_ids() == sorted(sid for sid, ns in sessions.items() if ns == "kept")
    assert store.get_prior("kept") is not None and store.log_size("kept") == (1, 5)
    # Again: nothing left to remove, and a namespace of that name starts afresh.
    assert store.delete_namespace("gone") == type(deleted)(False, 0, 0)
    assert store.register_namespace("gone", 50) and store.get_prior("gone") is None
    assert store.log_size("gone") == (0, 0)

"""rediss:// and rediss+cluster:// against real TLS-only servers (no plain port open), with a
throwaway CA, client certificates required, and an ACL user in the URL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import migrations
from cache_service.app import prepare_schema
from cache_service.storage import RedisStore, StorageUnavailable
from cache_service.storage.connect import connect
from tests.storage.conftest import stored
from tests.storage.servers import Cluster, RedisServer, TlsFiles

USER = ("tls-app", "tls-secret")
ACL = ("--user", USER[0], "on", f">{USER[1]}", "~*", "&*", "+@all", "--user", "default", "off")
PROBE = {"username": USER[0], "password": USER[1]}


@pytest.fixture
def tls_server(tls_server_binary: Path, tls_files: TlsFiles, tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tls_server_binary, tmp_path / "tls", *ACL, tls=tls_files, probe=PROBE).start()
    yield server
    server.stop()


def _round_trip(store: RedisStore) -> None:
    """Every kind of key the service writes, written and read back."""
    assert store.register_namespace("n", 32000)
    ids = store.append_requests("n", [np.array([1, 2, 3], np.int32)])
    assert [e.id for e in store.read_log("n")] == ids
    version = store.put_prior("n", b"prior" * 100)
    assert store.get_prior("n") == (version, b"prior" * 100)
    store.save_session("s", stored([1, 2], 1, [((1,), [((2,), 3)])]), ttl_s=60)
    loaded = store.load_session("s")
    assert loaded is not None and loaded.snapshot.rejected.items() == [((1,), [((2,), 3)])]
    assert store.session_ids() == ["s"]


def test_a_tls_server_with_credentials_and_a_client_certificate(tls_server: RedisServer, tls_files: TlsFiles) -> None:
    url = f"rediss://{USER[0]}:{USER[1]}@127.0.0.1:{tls_server.port}/0?{tls_files.query()}"
    client = connect(url)
    assert prepare_schema(client) == migrations.LATEST
    _round_trip(RedisStore(client))


def test_tls_peers_are_checked(tls_server: RedisServer, tls_files: TlsFiles) -> None:
    base = f"rediss://{USER[0]}:{USER[1]}@127.0.0.1:{tls_server.port}/0"
    own_cert = f"ssl_certfile={tls_files.cert}&ssl_keyfile={tls_files.key}"
    refused = [
        f"{base}?ssl_ca_certs={tls_files.ca}",  # no client certificate, and the server requires one
        f"{base}?{own_cert}",  # the server's certificate is not signed by a system CA
        f"redis://{USER[0]}:{USER[1]}@127.0.0.1:{tls_server.port}/0",  # plain text to a TLS port
    ]
    for url in refused:
        with pytest.raises(StorageUnavailable):
            RedisStore(connect(url, socket_timeout=2)).ping()
    # Options pass through to the TLS layer: no server verification, but still a client certificate.
    assert RedisStore(connect(f"{base}?{own_cert}&ssl_cert_reqs=none")).ping() < 1


def test_a_tls_cluster(tls_server_binary: Path, tls_files: TlsFiles, tmp_path: Path) -> None:
    cluster = Cluster(tls_server_binary, tmp_path / "cluster", *ACL, tls=tls_files, credentials=USER)
    try:
        client = connect(cluster.start().url)
        assert prepare_schema(client) == migrations.LATEST
        _round_trip(RedisStore(client))
    finally:
        cluster.stop()

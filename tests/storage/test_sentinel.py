"""redis+sentinel:// against a real Sentinel (``redis-server --sentinel``) watching a real master
and its replica on loopback, all password-protected, including a failover."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.sentinel import MasterNotFoundError

import migrations
from cache_service.app import prepare_schema
from cache_service.storage import RedisStore, keys
from cache_service.storage.connect import connect
from tests.storage.servers import RedisServer

SERVICE = "draftcache-test"
USER = ("sentinel-app", "data-secret")
SENTINEL_PASSWORD = "sentinel-secret"
DATA_ARGS = ("--user", USER[0], "on", f">{USER[1]}", "~*", "&*", "+@all", "--user", "default", "off")
DATA_ARGS += ("--masteruser", USER[0], "--masterauth", USER[1], "--repl-diskless-sync-delay", "0")


@dataclass
class Deployment:
    master: RedisServer
    replica: RedisServer
    sentinel: RedisServer

    @property
    def url(self) -> str:
        sentinel = f"127.0.0.1:{self.sentinel.port}"
        return f"redis+sentinel://{USER[0]}:{USER[1]}@{sentinel}/{SERVICE}/0?sentinel_password={SENTINEL_PASSWORD}"


def _until(condition: Callable[[], object], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def deployment(server_binary: Path, tmp_path: Path) -> Iterator[Deployment]:
    probe = {"username": USER[0], "password": USER[1], "decode_responses": True}
    started: list[RedisServer] = []
    try:
        master = RedisServer(server_binary, tmp_path / "master", *DATA_ARGS, probe=probe)
        started.append(master.start())
        replica = RedisServer(server_binary, tmp_path / "replica", *DATA_ARGS, probe=probe)
        started.append(replica.start("--replicaof", "127.0.0.1", str(master.port)))
        _until(lambda: replica.client().info("replication")["master_link_status"] == "up", "replication")
        conf = f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1\n"
        conf += f"sentinel auth-user {SERVICE} {USER[0]}\nsentinel auth-pass {SERVICE} {USER[1]}\n"
        conf += f"requirepass {SENTINEL_PASSWORD}\n"
        sentinel = RedisServer(
            server_binary, tmp_path / "sentinel", "--sentinel", conf=conf, probe={"password": SENTINEL_PASSWORD}
        )
        try:
            started.append(sentinel.start())
        except RuntimeError as exc:
            pytest.skip(f"{server_binary} cannot run as a Sentinel (redis-server --sentinel): {exc}")
        yield Deployment(master, replica, sentinel)
    finally:
        for server in reversed(started):
            server.stop()


def test_the_url_reaches_the_master_sentinel_names(deployment: Deployment) -> None:
    client = connect(deployment.url)
    assert client.connection_pool.get_master_address() == ("127.0.0.1", deployment.master.port)
    assert prepare_schema(client) == migrations.LATEST
    store = RedisStore(client)
    ids = store.append_requests("n", [np.array([1, 2, 3], np.int32)])
    assert deployment.master.client().xrange(keys.log("n"))[0][0] == ids[0]  # written on the master


def test_the_store_follows_a_failover(deployment: Deployment) -> None:
    client = connect(deployment.url)
    store = RedisStore(client)
    ids = store.append_requests("n", [np.array([1, 2, 3], np.int32)])
    assert deployment.master.client().wait(1, 2000) == 1  # the replica has it too
    sentinel = deployment.sentinel.client()
    _until(lambda: sentinel.execute_command("SENTINEL REPLICAS", SERVICE), "Sentinel to discover the replica")

    deployment.master.kill()

    def failover() -> bool:
        try:
            return bool(sentinel.execute_command("SENTINEL FAILOVER", SERVICE))
        except redis.ResponseError:  # NOGOODSLAVE until Sentinel has a fresh view of the replica
            return False

    _until(failover, "Sentinel to accept the failover")
    promoted = ("127.0.0.1", deployment.replica.port)

    def master_address() -> tuple[str, int] | None:
        try:
            return client.connection_pool.get_master_address()
        except MasterNotFoundError:  # some Sentinels report no master while the failover runs
            return None

    _until(lambda: master_address() == promoted, "the replica's promotion")
    # The connection to the dead master is dropped; the next command finds the new one.
    more = store.append_requests("n", [np.array([4], np.int32)])
    assert [e.id for e in store.read_log("n")] == ids + more
    assert store.log_size("n") == (2, 4)

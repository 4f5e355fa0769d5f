"""The embedded Redis's supervisor checks the server without costing the serving process: its
PINGs share one connection, and a server that died is found and started again on the same port."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import redis

from cache_service.config import EmbeddedRedisConfig
from cache_service.host.embedded_redis import PING_EVERY_S, EmbeddedRedis
from tests.faults import kill, wait_for


def _connections(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return int(client.info("stats")["total_connections_received"])


def test_the_supervisors_pings_reuse_one_connection_and_reconnect_after_a_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    try:
        server.supervise()
        time.sleep(2 * PING_EVERY_S)  # the first PING connects
        before = _connections(server.url)
        time.sleep(6 * PING_EVERY_S)  # six more PINGs
        assert _connections(server.url) - before == 1  # only this check's own connection
        old = server._proc
        assert old is not None
        kill(old.pid, signal.SIGKILL)
        wait_for(lambda: server.restarts == 1, 20, "the server to be restarted")
        time.sleep(2 * PING_EVERY_S)  # the pinger's old connection failed; it connects again
        before = _connections(server.url)
        time.sleep(6 * PING_EVERY_S)
        assert _connections(server.url) - before == 1
        assert server._pinger is not None and server._pinger.ping()
    finally:
        server.stop()

"""The embedded Redis never takes a port the service is about to bind itself: a fixed serving
port in the kernel's ephemeral range is free while the service starts (after a crash, say), and
the kernel may hand it to the embedded Redis first."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from cache_service.config import EmbeddedRedisConfig
from cache_service.host.embedded_redis import EmbeddedRedis, free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _most_of_the_ephemeral_range() -> frozenset[int]:
    """All but the top 1,000 ports the kernel hands out for port 0: a port it picks is almost
    always one of them, so a choice that ignored them would be caught."""
    if not RANGE.is_file():
        pytest.skip("needs Linux's ephemeral port range")
    lo, hi = (int(x) for x in RANGE.read_text().split())
    if hi - lo < 4000:
        pytest.skip(f"ephemeral range {lo}-{hi} too narrow to tell")
    return frozenset(range(lo, hi - 1000))


def test_a_free_port_is_none_of_the_ports_to_avoid() -> None:
    avoid = _most_of_the_ephemeral_range()
    for _ in range(5):
        assert free_port(avoid) not in avoid


def test_the_embedded_redis_serves_on_a_port_the_service_does_not_bind(tmp_path: Path) -> None:
    avoid = _most_of_the_ephemeral_range()
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False), avoid=avoid).start()
    try:
        assert server.port not in avoid
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
    finally:
        server.stop()

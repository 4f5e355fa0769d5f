"""Redis URLs: what each scheme names, and the mistakes refused before anything connects."""

from __future__ import annotations

import re

import pytest
import redis

from cache_service.host.embedded_redis import free_port
from cache_service.storage import StorageError, StorageUnavailable
from cache_service.storage.connect import connect, parse_url, redact


def test_one_server_urls_keep_redis_py_meaning() -> None:
    target = parse_url("redis://app:p%40ss@cache.internal:6380/3?socket_timeout=5")
    assert (target.kind, target.tls, target.nodes) == ("single", False, (("cache.internal", 6380),))
    assert target.options["username"] == "app" and target.options["password"] == "p@ss"  # percent-decoded
    assert target.options["db"] == 3 and target.options["socket_timeout"] == 5.0
    assert parse_url("redis://cache").nodes == (("cache", 6379),)


def test_tls_options_pass_through() -> None:
    url = "rediss://cache:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem&ssl_cert_reqs=required"
    target = parse_url(url)
    assert target.tls and target.options["ssl"] is True
    assert target.options["ssl_ca_certs"] == "/etc/ca.pem" and target.options["ssl_keyfile"] == "/k.pem"
    assert target.options["ssl_cert_reqs"] == "required"
    client = connect(url)  # nothing connects yet: the pool holds the options redis-py will use
    assert isinstance(client, redis.Redis)
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert client.get_connection_kwargs()["ssl_certfile"] == "/c.pem"


def test_cluster_urls_list_seed_nodes() -> None:
    target = parse_url("rediss+cluster://app:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002?ssl_ca_certs=/ca.pem")
    assert target.kind == "cluster" and target.tls
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (target.options["username"], target.options["password"], target.options["ssl"]) == ("app", "pw", True)


def test_sentinel_urls_name_the_service_and_database() -> None:
    target = parse_url("redis+sentinel://:master-pw@s1,s2:26380/cache/2?sentinel_password=s-pw&socket_timeout=3")
    assert target.kind == "sentinel" and target.service == "cache"
    assert target.nodes == (("s1", 26379), ("s2", 26380))  # Sentinel's default port
    assert target.options["password"] == "master-pw" and target.options["db"] == 2
    # The sentinels get their own credentials and the socket options, never the master's password.
    assert target.sentinel_options == {"password": "s-pw", "socket_timeout": 3.0}


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("memcached://cache:11211", "unknown Redis URL scheme 'memcached://'"),
        ("cache:6379", "not a Redis URL"),
        ("redis://a:6379,b:6379/0", "names one server"),
        ("redis://cache:6379/zero", "bad database"),
        ("redis://cache:99999/0", "out of range"),
        ("redis://cache/0?ssl_ca_certs=/ca.pem", "need a TLS URL"),
        ("redis://cache/0?sokcet_timeout=1", "unknown option(s) sokcet_timeout"),
        ("redis+cluster://a:7000,b:7000/1", "only database 0"),
        ("redis+cluster://a:7000?db=2", "only database 0"),
        ("redis+cluster://a:7000,,b:7000", "bad host:port"),
        ("redis+sentinel://s1:26379", "service name"),
        ("redis+sentinel://s1:26379/cache/1/2", "bad database"),
        ("redis://cache/0?sentinel_password=x", "unknown option(s) sentinel_password"),
    ],
)
def test_bad_urls_are_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        connect(url)


def test_passwords_never_reach_error_messages() -> None:
    assert redact("redis+sentinel://u:hunter2@s1:26379/m") == "redis+sentinel://u:***@s1:26379/m"
    with pytest.raises(ValueError) as info:
        connect("redis://u:hunter2@a,b/0")
    assert "hunter2" not in str(info.value)


def test_a_cluster_url_to_something_else_is_a_clear_error(redis_url: str) -> None:
    port = parse_url(redis_url).nodes[0][1]
    with pytest.raises(StorageError, match=r"not a usable Redis Cluster at 127\.0\.0\.1"):
        connect(f"redis+cluster://127.0.0.1:{port}")  # one server, not in cluster mode
    with pytest.raises(StorageUnavailable):
        connect(f"redis+cluster://127.0.0.1:{free_port()}")  # nothing listening

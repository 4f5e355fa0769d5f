"""Redis URLs -> storage clients, in one place.

Schemes (``[user[:password]@]`` authenticates to the data nodes in every kind)::

    redis://[user:password@]host[:port][/db][?option=value&...]      one server
    rediss://...                                                      one server over TLS
    unix://[user:password@]/path/redis.sock[?db=N&...]                one server on a socket
    redis+cluster://[user:password@]host:port[,host:port...][?...]   Redis Cluster (seed nodes)
    rediss+cluster://...                                              Redis Cluster over TLS
    redis+sentinel://[user:password@]host:port[,host:port...]/service[/db][?...]
    rediss+sentinel://...                                             the master Sentinel names

Options are redis-py's connection arguments (as ``redis.Redis.from_url`` reads them):
``socket_timeout``, ``socket_connect_timeout``, ``socket_keepalive``, ``retry_on_timeout``,
``max_connections``, ``health_check_interval``, ``client_name``, ``protocol``, and for TLS
``ssl_ca_certs``, ``ssl_ca_path``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_password``,
``ssl_cert_reqs`` (``none``/``optional``/``required``), ``ssl_check_hostname``,
``ssl_min_version``. Sentinel URLs also take ``sentinel_username`` and ``sentinel_password``
for the sentinels themselves; socket and TLS options apply to the sentinels too.

>>> parse_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7000").nodes
(('10.0.0.1', 7000), ('10.0.0.2', 7000))
>>> connect("redis+sentinel://s1:26379,s2:26379/cache/0")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import redis
from redis.backoff import AbstractBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url as redis_parse_url
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry
from redis.sentinel import Sentinel

from cache_service.storage.clients import StorageClient
from cache_service.storage.errors import StorageError, translate

# scheme -> (kind, tls)
SCHEMES: dict[str, tuple[str, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
DEFAULT_PORT = {"single": 6379, "cluster": 6379, "sentinel": 26379}
CUT_MESSAGE = "storage calls cut short: the service is stopping"

T = TypeVar("T")

_CONNECTION_OPTIONS = frozenset(
    {"db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry_on_timeout"}
    | {"max_connections", "health_check_interval", "client_name", "protocol"}
)
_TLS_OPTIONS = frozenset(
    {"ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password"}
    | {"ssl_cert_reqs", "ssl_check_hostname", "ssl_min_version"}
)
_SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})
_NODE = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\[\]:/]+))(?::(?P<port>\d{1,5}))?")
_SERVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _defaults() -> dict[str, Any]:
    """Raw bytes, one quick retry, timeouts long enough for a 64 MB prior part, short enough
    that a dead server fails a sync job quickly."""
    return {
        "decode_responses": False,
        "socket_timeout": 30.0,
        "socket_connect_timeout": 2.0,
        "retry": Retry(NoBackoff(), 1),
    }


@dataclass(frozen=True, kw_only=True)
class RedisTarget:
    """What a URL names: the kind of deployment, its nodes and the connection arguments.

    ``options`` are redis-py keyword arguments for the data connections (credentials included);
    ``sentinel_options`` those for the sentinels.
    """

    kind: str  # "single", "cluster" or "sentinel"
    tls: bool
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_options: dict[str, Any] = field(default_factory=dict)

    @property
    def hosts(self) -> str:
        """The nodes as ``host:port,...`` (no credentials)."""
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)


def redact(url: str) -> str:
    """``url`` with its password hidden, for messages and logs.

    >>> redact("redis://app:s3cret@cache:6379/0")
    'redis://app:***@cache:6379/0'
    """
    return re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", url)


def parse_url(url: str) -> RedisTarget:
    """Validate ``url`` and say what it names; ``ValueError`` with the reason otherwise."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"not a Redis URL: {redact(str(url))!r} (expected e.g. redis://host:6379/0)")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise ValueError(f"unknown Redis URL scheme {scheme + '://'!r} in {redact(url)!r}; use one of {known}")
    kind, tls = SCHEMES[scheme]
    parts = urlsplit(url)
    query = {name: values[-1] for name, values in parse_qs(parts.query, keep_blank_values=True).items()}
    _check_options(query, kind=kind, tls=tls, url=url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"unix:// URL names no socket path: {redact(url)!r}")
        return RedisTarget(kind=kind, tls=tls, options=redis_parse_url(url))
    nodes = _nodes(hosts, DEFAULT_PORT[kind], url=url)
    if kind == "single" and len(nodes) > 1:
        raise ValueError(f"{scheme}:// names one server, got {len(nodes)} in {redact(url)!r}; see redis+cluster://")
    service, db = _path(parts.path, kind=kind, url=url)
    sentinel = {k: query.pop(k) for k in _SENTINEL_OPTIONS & query.keys()}
    options = _node_options(tls, userinfo, query, db)
    if kind == "sentinel":
        shared = {k: v for k, v in options.items() if k.startswith(("socket_", "ssl"))}
        named = {k.removeprefix("sentinel_"): v for k, v in sentinel.items()}
        return RedisTarget(
            kind=kind, tls=tls, nodes=nodes, service=service, options=options, sentinel_options={**shared, **named}
        )
    return RedisTarget(kind=kind, tls=tls, nodes=nodes, options=options)


def _check_options(query: dict[str, str], *, kind: str, tls: bool, url: str) -> None:
    allowed = _CONNECTION_OPTIONS | _TLS_OPTIONS | (_SENTINEL_OPTIONS if kind == "sentinel" else frozenset())
    unknown = sorted(query.keys() - allowed)
    if unknown:
        known = ", ".join(sorted(allowed))
        raise ValueError(f"unknown option(s) {', '.join(unknown)} in {redact(url)!r}; known: {known}")
    tls_only = sorted(query.keys() & _TLS_OPTIONS)
    if tls_only and not tls:
        raise ValueError(f"{', '.join(tls_only)} need a TLS URL (rediss://, rediss+cluster://, rediss+sentinel://)")
    if kind == "cluster" and query.get("db", "0") != "0":
        raise ValueError(f"a Redis Cluster has only database 0: {redact(url)!r}")


def _nodes(hosts: str, default_port: int, *, url: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for item in hosts.split(","):
        match = _NODE.fullmatch(item.strip())
        if not match:
            raise ValueError(f"bad host:port {item!r} in {redact(url)!r}")
        port = int(match["port"] or default_port)
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} out of range in {redact(url)!r}")
        nodes.append((match["v6"] or match["host"], port))
    return tuple(nodes)


def _path(path: str, *, kind: str, url: str) -> tuple[str | None, int]:
    """``(service, db)`` from the URL path: ``/db`` for a server, ``/service[/db]`` for Sentinel."""
    segments = [s for s in path.split("/") if s]
    if kind == "sentinel":
        if not segments or not _SERVICE.fullmatch(segments[0]):
            raise ValueError(f"redis+sentinel:// needs the master's service name as its path: {redact(url)!r}")
        service, rest = segments[0], segments[1:]
    else:
        service, rest = None, segments
    if len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise ValueError(f"bad database {'/'.join(rest)!r} in {redact(url)!r} (expected /<number>)")
    db = int(rest[0]) if rest else 0
    if kind == "cluster" and db != 0:
        raise ValueError(f"a Redis Cluster has only database 0: {redact(url)!r}")
    return service, db


def _node_options(tls: bool, userinfo: str, query: dict[str, str], db: int) -> dict[str, Any]:
    """redis-py's own reading of credentials and options, as for a one-server URL."""
    credentials = f"{userinfo}@" if userinfo else ""
    synthetic = f"{'rediss' if tls else 'redis'}://{credentials}localhost/{db}?{urlencode(query, quote_via=quote)}"
    options = redis_parse_url(synthetic)
    options.pop("host", None)
    options.pop("port", None)
    if options.pop("connection_class", None) is not None and tls:
        options["ssl"] = True
    return options


def connect(url: str, *, cutoff: Cutoff | None = None, **overrides: Any) -> StorageClient:
    """A storage client for ``url``: a ``redis.Redis`` (one server or the Sentinel master) or a
    ``RedisCluster``. ``overrides`` replace the defaults (``decode_responses=False``, 30 s reads,
    2 s connects, one retry without backoff), and the URL's options replace both. With
    ``cutoff``, :meth:`Cutoff.cut` ends the client's calls at once.

    A cluster is contacted at once to learn its slots (:class:`StorageUnavailable` if no seed
    node answers); the other kinds connect on first use.
    """
    target = parse_url(url)
    settings = {**_defaults(), **overrides}
    if cutoff is not None:
        settings["retry"] = cutoff.retry(settings["retry"])
    if target.kind == "cluster":
        client: StorageClient = _cluster(target, settings)
    elif target.kind == "sentinel":
        client = _sentinel(target, settings)
    else:
        client = redis.Redis.from_url(url, **settings)  # options in the URL win, as redis-py has it
    if cutoff is not None:
        cutoff.watch(client)
    return client


def connect_for_calls(url: str, timeout_s: float) -> StorageClient:
    """A client for what a call waits on: every read and connect within ``timeout_s``, no
    retry (the caller journals a commit, or fails the call, and the next one tries again)."""
    return connect(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))


def _cluster(target: RedisTarget, settings: dict[str, Any]) -> RedisCluster:
    options = {k: v for k, v in target.options.items() if k != "db"}
    retry = settings.pop("retry")
    nodes = [ClusterNode(host, port) for host, port in target.nodes]
    try:
        return RedisCluster(startup_nodes=nodes, retry=retry, **{**settings, **options})
    except (RedisError, RedisClusterException) as exc:
        # Unreachable nodes are StorageUnavailable; anything else (a node not in cluster mode,
        # slots left unassigned) is a deployment that is not the cluster the URL promises.
        raise translate(exc) or StorageError(f"not a usable Redis Cluster at {target.hosts}: {exc}") from exc


def _sentinel(target: RedisTarget, settings: dict[str, Any]) -> redis.Redis:
    if target.service is None:
        raise ValueError("a Sentinel URL must name the master's service")
    sentinel_settings = {k: v for k, v in settings.items() if k.startswith("socket_") or k == "retry"}
    sentinels = Sentinel(
        list(target.nodes),
        sentinel_kwargs={**sentinel_settings, **target.sentinel_options},
        **{**settings, **target.options},
    )
    client: redis.Redis = sentinels.master_for(target.service, redis_class=redis.Redis)
    return client


class Cutoff:
    """Ends the calls of the storage clients made with it (:func:`connect`), whatever Redis does.

    A stopping service cannot wait out a hung Redis: a call on a client with the defaults waits
    30 s for an answer, then once more. After :meth:`cut`, a call waiting on a socket fails at
    once (the client's connections are shut down under it), and every later call fails before
    anything is sent, as :class:`redis.ConnectionError` (storage unavailable), never retried,
    until :meth:`restore`. :meth:`cut_at` cuts at a deadline instead. On a Redis Cluster the
    calls under way are woken and not retried, but one begun after the cut is still sent (the
    cluster client retries and routes on its own): it waits for a node's socket timeout at most.

    >>> cutoff = Cutoff()
    >>> client = connect("redis://127.0.0.1:1/0", cutoff=cutoff)  # nothing listens there
    >>> cutoff.cut()
    >>> client.ping()
    Traceback (most recent call last):
    ...
    redis.exceptions.ConnectionError: storage calls cut short: the service is stopping
    """

    def __init__(self) -> None:
        self._cut = threading.Event()
        self._clients: list[StorageClient] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    @property
    def is_cut(self) -> bool:
        return self._cut.is_set()

    def retry(self, like: Retry) -> Retry:
        """A retry policy as ``like`` (its retries and backoff) that this cutoff ends."""
        return _CutRetry(self, like.get_retries(), getattr(like, "_backoff", NoBackoff()))

    def watch(self, client: StorageClient) -> None:
        """Shut ``client``'s connections down at each cut."""
        with self._lock:
            self._clients.append(client)

    def cut(self) -> None:
        """Fail the calls under way and every later one, until :meth:`restore`."""
        self._cut.set()
        with self._lock:
            clients = list(self._clients)
            if self._timer is not None:  # the deadline is moot
                self._timer.cancel()
                self._timer = None
        for client in clients:
            _disconnect(client)

    def cut_at(self, deadline: float) -> None:
        """:meth:`cut` when ``time.monotonic()`` reaches ``deadline`` (at once if it has)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self.cut)
            self._timer.daemon = True
            self._timer.start()

    def restore(self) -> None:
        """Let calls through again (a pending :meth:`cut_at` is called off)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._cut.clear()

    def check(self) -> None:
        if self._cut.is_set():
            raise redis.ConnectionError(CUT_MESSAGE)


class _CutRetry(Retry):
    """redis-py's retry policy, ended by a :class:`Cutoff`: no try once it is cut, and no retry
    of a try it cut. Every copy a connection takes shares the cutoff."""

    def __init__(self, cutoff: Cutoff, retries: int, backoff: AbstractBackoff) -> None:
        super().__init__(backoff, retries)
        self._cutoff = cutoff

    def __deepcopy__(self, memo: dict[int, Any]) -> _CutRetry:
        return copy.copy(self)  # each connection copies its retry: the cutoff stays shared

    def get_retries(self) -> int:
        return 0 if self._cutoff.is_cut else super().get_retries()

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        self._backoff.reset()
        failures = 0
        while True:
            self._cutoff.check()
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error) and not self._cutoff.is_cut:
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if self._cutoff.is_cut:
                    raise redis.ConnectionError(CUT_MESSAGE) from error
                if 0 <= self._retries < failures:
                    raise
                pause = self._backoff.compute(failures)
                if pause > 0:
                    time.sleep(pause)


def _disconnect(client: StorageClient) -> None:
    """Shut every connection of ``client`` down, those in use by other threads too: a thread
    waiting on one for an answer wakes at once with a connection error."""
    if isinstance(client, RedisCluster):
        client.disconnect_connection_pools()
    else:
        client.connection_pool.disconnect(inuse_connections=True)

"""Prometheus metrics: request latency by method and status, rebuild durations, and the
service's state read at scrape time (sessions, buffer fill, accepted tokens by tier and
namespace, pre-speculation hits, write-back lag).

Everything lives in one registry per service (not the process-global one), so several servers
in one process (tests) keep their figures apart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache_service.domain.ports import StorageHealth
from cache_service.domain.service import DraftService
from indexer.lifetime_index import LifetimeIndexes

# Draft calls take tens of microseconds to tens of milliseconds.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0)
REBUILD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class WriteBack(Protocol):
    """What storage reports about writes it has not made yet."""

    @property
    def pending(self) -> int: ...

    def oldest_pending_age_s(self) -> float: ...


@dataclass
class Metrics:
    """The service's metrics; ``observe_rpc`` and ``observe_rebuild`` are called as things happen."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        # The namespaces served now (see :meth:`served_by`), and the rebuild series recorded:
        # those of a deleted namespace go, or names that come and go would pile up series.
        self._served: Callable[[], Iterable[str]] | None = None
        self._rebuild_series: set[tuple[str, str, str]] = set()
        self._series_lock = threading.Lock()
        self.rpc_seconds = Histogram(
            "draftcache_rpc_seconds",
            "Server-side handling time of each call, by method and status code.",
            ("method", "code"),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rebuild_seconds = Histogram(
            "draftcache_rebuild_seconds",
            "Lifetime index rebuilds, by namespace and how the suffix array was made (extended: the "
            "last generation's merged with what is new; sorted: the whole buffer afresh), their "
            "n-gram table rebuilt or carried over (table: new / carried).",
            ("namespace", "suffix", "table"),
            buckets=REBUILD_BUCKETS,
            registry=None,
        )
        self.registry.register(_Pruned(self.rebuild_seconds, self._drop_gone))
        self.embedded_restarts = Counter(
            "draftcache_embedded_redis_restarts",
            "Times the embedded Redis was restarted after it died.",
            registry=self.registry,
        )
        self.compiles_while_serving = Counter(
            "draftcache_compiles_while_serving",
            "Compiled loops built after start-up (the serving loop waits for each; see the log).",
            registry=self.registry,
        )

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_seconds.labels(method.rsplit("/", 1)[-1], code).observe(seconds)

    def observe_rebuild(self, namespace: str, built: LifetimeIndexes) -> None:
        suffix = "extended" if built.extended else "sorted"
        table = "new" if built.table_version is None else "carried"
        self._drop_gone()
        with self._series_lock:
            self._rebuild_series.add((namespace, suffix, table))
            self.rebuild_seconds.labels(namespace, suffix, table).observe(built.build_seconds)

    def served_by(self, namespaces: Callable[[], Iterable[str]]) -> None:
        """Keep per-namespace series only for the ``namespaces()`` served now (a namespace
        deleted takes its series along); :meth:`watch` sets it from the service."""
        self._served = namespaces

    def _drop_gone(self) -> None:
        """Remove the rebuild series of namespaces no longer served."""
        if self._served is None:
            return
        served = set(self._served())
        with self._series_lock:
            gone = {labels for labels in self._rebuild_series if labels[0] not in served}
            for labels in gone:
                self.rebuild_seconds.remove(*labels)
            self._rebuild_series -= gone

    def observe_embedded_restart(self) -> None:
        self.embedded_restarts.inc()

    def observe_compile(self) -> None:
        self.compiles_while_serving.inc()

    def watch(
        self,
        service: DraftService,
        write_back: WriteBack | None = None,
        *,
        session_saves: Callable[[], float] | None = None,
        storage: Callable[[], StorageHealth] | None = None,
    ) -> None:
        """Report ``service``'s state (and ``storage``'s health) at every scrape."""
        self.served_by(service.namespace_names)
        self.registry.register(ServiceCollector(service, write_back, session_saves))
        if storage is not None:
            self.registry.register(StorageCollector(storage))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose ``/metrics`` over HTTP; returns the bound port (``port=0`` picks one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)


class _Pruned(Collector):
    """A metric collected after ``prune`` ran (which drops its series that must go)."""

    def __init__(self, metric: Histogram, prune: Callable[[], None]) -> None:
        self._metric = metric
        self._prune = prune

    def collect(self) -> Iterable[Metric]:
        self._prune()
        return self._metric.collect()


class ServiceCollector(Collector):
    """Gauges and counters computed from the service when scraped."""

    def __init__(
        self, service: DraftService, write_back: WriteBack | None, session_saves: Callable[[], float] | None
    ) -> None:
        self._service = service
        self._write_back = write_back
        self._session_saves = session_saves

    def collect(self) -> Iterator[Metric]:
        s = self._service
        sessions = GaugeMetricFamily("draftcache_sessions", "Open sessions, by namespace.", labels=["namespace"])
        buffered = GaugeMetricFamily("draftcache_buffer_tokens", "Tokens in the lifetime buffer.", labels=["namespace"])
        fill = GaugeMetricFamily("draftcache_buffer_fill_ratio", "Lifetime buffer fill (0-1).", labels=["namespace"])
        delta = GaugeMetricFamily(
            "draftcache_delta_tokens", "Tokens committed since the last rebuild.", labels=["namespace"]
        )
        steps = CounterMetricFamily("draftcache_steps", "Verification outcomes reported.", labels=["namespace"])
        drafted = CounterMetricFamily("draftcache_drafted_tokens", "Draft tree nodes proposed.", labels=["namespace"])
        accepted = CounterMetricFamily(
            "draftcache_accepted_tokens", "Accepted draft tokens, by tier.", labels=["namespace", "tier"]
        )
        ahead = CounterMetricFamily(
            "draftcache_prespeculation",
            "Outcomes of pre-speculated steps: hit (a tree was drafted ahead) or miss.",
            labels=["namespace", "result"],
        )
        counts = s.sessions.count_by_namespace()
        for name in s.namespace_names():
            d = s.namespace(name)
            memory, c = d.memory, d.counters
            sessions.add_metric([name], counts.get(name, 0))
            buffered.add_metric([name], memory.buffered_tokens)
            fill.add_metric([name], memory.buffered_tokens / memory.capacity)
            delta.add_metric([name], memory.delta_tokens())
            steps.add_metric([name], c.steps)
            drafted.add_metric([name], c.drafted)
            for tier, n in c.accepted.items():
                accepted.add_metric([name, tier], n)
            ahead.add_metric([name, "hit"], c.ahead_hits)
            ahead.add_metric([name, "miss"], c.ahead_misses)
        yield from (sessions, buffered, fill, delta, steps, drafted, accepted, ahead)
        yield CounterMetricFamily("draftcache_drafts", "Draft trees served.", value=s.drafts)
        yield CounterMetricFamily(
            "draftcache_drafts_ahead_skipped",
            "Draft items that asked for outcomes drafted ahead and got none: drafting kept the process too busy.",
            value=s.ahead_skipped,
        )
        yield GaugeMetricFamily(
            "draftcache_session_tokens", "Context tokens held by sessions in memory.", value=s.sessions.tokens
        )
        yield CounterMetricFamily(
            "draftcache_sessions_evicted", "Sessions that left memory for room.", value=s.sessions.evicted
        )
        if self._write_back is not None:
            yield GaugeMetricFamily(
                "draftcache_writeback_pending", "Commits waiting for storage.", value=self._write_back.pending
            )
            yield GaugeMetricFamily(
                "draftcache_writeback_lag_seconds",
                "Age of the oldest commit waiting for storage (0: none waiting).",
                value=self._write_back.oldest_pending_age_s(),
            )
        if self._session_saves is not None:
            yield GaugeMetricFamily(
                "draftcache_session_save_age_seconds",
                "Time since storage last held every session change (grows while write-backs fail).",
                value=max(0.0, time.monotonic() - self._session_saves()),
            )


class StorageCollector(Collector):
    """Storage health gauges, read when scraped (:class:`StorageHealth`)."""

    def __init__(self, storage: Callable[[], StorageHealth]) -> None:
        self._storage = storage

    def collect(self) -> Iterator[Metric]:
        h = self._storage()
        yield GaugeMetricFamily("draftcache_storage_up", "1 while writes reach storage.", value=h.available)
        yield GaugeMetricFamily(
            "draftcache_storage_disk_full", "1 while the last storage failure is a full disk.", value=h.disk_full
        )
        yield GaugeMetricFamily(
            "draftcache_storage_unavailable_seconds", "Time storage has been unreachable.", value=h.unavailable_seconds
        )
        yield GaugeMetricFamily(
            "draftcache_journal_commits",
            "Acknowledged commits in the local journal, not yet in storage.",
            value=h.journaled_commits,
        )
        yield GaugeMetricFamily("draftcache_journal_bytes", "Size of the local commit journal.", value=h.journal_bytes)
        yield GaugeMetricFamily(
            "draftcache_journal_capacity_bytes", "Most bytes the journal may hold.", value=h.journal_capacity_bytes
        )
        yield CounterMetricFamily(
            "draftcache_repeated_commits",
            "Commits acknowledged but not appended: the log held them already (a client's retry, a journal replay).",
            value=h.repeated_commits,
        )

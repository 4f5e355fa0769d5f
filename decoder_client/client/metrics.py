"""A draft client's counts (:class:`~decoder_client.client.core.ClientStats`) as Prometheus
metrics, read at scrape time: where an engine's drafts came from (the service, a near copy, the
local fallback), the calls that failed, the commits kept, retried and dropped, what a near copy
took from the fleet. The service sees none of this: a client past its deadline, or one that
cannot reach the service, drafts alone without telling it. The engine integrations serve these
on ``metrics_port`` (:class:`~decoder_client.engines.settings.EngineSettings`).

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> from decoder_client.client.core import ClientStats
>>> stats = ClientStats(near=40, fallback=2, commits_dropped=1)
>>> registry = CollectorRegistry()
>>> registry.register(ClientCollector(lambda: stats, namespace="chat", engine="vllm"))
>>> text = generate_latest(registry).decode()
>>> 'draftcache_client_drafts_total{engine="vllm",namespace="chat",source="near"} 40.0' in text
True
>>> 'draftcache_client_commits_dropped_total{engine="vllm",namespace="chat"} 1.0' in text
True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decoder_client.client.core import ClientStats

logger = logging.getLogger(__name__)

_LABELS = ["namespace", "engine"]
# ClientStats field -> (metric, help): counters, each a total since the client was made.
_COUNTERS = {
    "failures": ("draftcache_client_failed_calls", "Calls to the service that failed or missed their deadline."),
    "draft_calls": ("draftcache_client_draft_calls", "Draft calls a step waited on."),
    "draft_wait_s": ("draftcache_client_draft_wait_seconds", "Time steps waited on draft calls."),
    "continued": ("draftcache_client_chains_continued", "Chains that went on from the last one without a call."),
    "reopened": ("draftcache_client_sessions_reopened", "Sessions opened again with their context (a copy was lost)."),
    "lost_opens": ("draftcache_client_lost_opens", "Opens given up on past their deadline."),
    "malformed": ("draftcache_client_malformed_drafts", "Drafts from the service not used (out of the vocabulary)."),
    "commits_retried": ("draftcache_client_commits_retried", "Ended requests whose commit did not land at once."),
    "commits_dropped": (
        "draftcache_client_commits_dropped",
        "Ended requests never committed (the backlog full, or refused): the fleet's memory lacks them.",
    ),
    "followed": ("draftcache_client_near_followed", "Other replicas' requests a near copy took from the log."),
}
_GAUGES = {
    "commits_pending": ("draftcache_client_commits_pending", "Ended requests not committed yet."),
    "prior_version": ("draftcache_client_near_prior_version", "The static prior a near copy serves (0: none)."),
}
# Where a step's drafts came from.
_SOURCES = {"remote": "service", "near": "near", "fallback": "fallback"}
# An engine's own counts beside the client's (the engine integration's, where the engine keeps
# none of its own): name -> (metric, help).
ENGINE_COUNTS = {
    "steps": ("draftcache_engine_steps", "Verification steps the engine drafted for."),
    "proposed": ("draftcache_engine_proposed_tokens", "Draft tokens proposed to the engine."),
    "accepted": ("draftcache_engine_accepted_tokens", "Draft tokens the engine accepted."),
}


class ClientCollector(Collector):
    """``stats()`` (and ``engine_counts()``: keys of :data:`ENGINE_COUNTS`) as metrics labelled
    with the namespace and the engine."""

    def __init__(
        self,
        stats: Callable[[], ClientStats],
        *,
        namespace: str,
        engine: str,
        engine_counts: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self._stats = stats
        self._labels = [namespace, engine]
        self._engine_counts = engine_counts

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        drafts = CounterMetricFamily(
            "draftcache_client_drafts",
            "Drafts a step took, by source: the service, a near copy in this process, or the local fallback.",
            labels=[*_LABELS, "source"],
        )
        for field, source in _SOURCES.items():
            drafts.add_metric([*self._labels, source], getattr(s, field))
        yield drafts
        ahead = CounterMetricFamily(
            "draftcache_client_ahead",
            "Outcomes drafted ahead: hit (the draft was ready) or miss.",
            labels=[*_LABELS, "result"],
        )
        ahead.add_metric([*self._labels, "hit"], s.ahead_hits)
        ahead.add_metric([*self._labels, "miss"], s.ahead_misses)
        yield ahead
        for field, (name, text) in _COUNTERS.items():
            counter = CounterMetricFamily(name, text, labels=_LABELS)
            counter.add_metric(self._labels, getattr(s, field))
            yield counter
        for field, (name, text) in _GAUGES.items():
            gauge = GaugeMetricFamily(name, text, labels=_LABELS)
            gauge.add_metric(self._labels, getattr(s, field))
            yield gauge
        if self._engine_counts is not None:
            counts = self._engine_counts()
            for key, (name, text) in ENGINE_COUNTS.items():
                counter = CounterMetricFamily(name, text, labels=_LABELS)
                counter.add_metric(self._labels, counts[key])
                yield counter


class ClientMetrics:
    """A :class:`ClientCollector` served over HTTP (``/metrics``) until :meth:`close`."""

    def __init__(self, collector: ClientCollector, port: int, host: str = "127.0.0.1") -> None:
        registry = CollectorRegistry()
        registry.register(collector)
        self._server, _ = start_http_server(port, addr=host, registry=registry)
        self.port = int(self._server.server_port)

    @classmethod
    def serve(cls, collector: ClientCollector, port: int, host: str = "127.0.0.1") -> ClientMetrics | None:
        """Served on ``port``; ``None`` (logged) where it cannot be bound: an engine does not
        stop for its metrics."""
        try:
            served = cls(collector, port, host)
        except OSError as exc:
            logger.error("draftcache: cannot serve the client's metrics on %s:%d: %s", host, port, exc)
            return None
        logger.info("draftcache: client metrics on http://%s:%d/metrics", host, served.port)
        return served

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

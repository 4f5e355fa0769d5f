"""A draft client's counts (:class:`~decoder_client.client.core.ClientStats`) as Prometheus
metrics, read at scrape time: where an engine's drafts came from (the service, a near copy, the
local fallback), the calls that failed, the commits kept, retried and dropped, what a near copy
took from the fleet. The service sees none of this: a client past its deadline, or one that
cannot reach the service, drafts alone without telling it. The engine integrations serve these
on ``metrics_port`` (:class:`~decoder_client.engines.settings.EngineSettings`), and where
their process keeps prometheus_client's multiprocess values (``PROMETHEUS_MULTIPROC_DIR``) they
write them there too (:class:`MultiprocessMirror`), for a server that collects that directory
to serve with its own: vLLM's OpenAI server, whose proposer runs in its engine's process.

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
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

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
# How a gauge's values from several processes (of one directory) are served: summed, but a
# version is the newest any live process serves.
_GAUGE_MODES = {"draftcache_client_near_prior_version": "livemax"}
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


class MultiprocessMirror:
    """A collector's metrics written where prometheus_client's multiprocess mode keeps every
    process's values (``PROMETHEUS_MULTIPROC_DIR``), every ``period_s`` on a thread of its own
    and at :meth:`close`. A server that collects that directory serves them beside its own:
    vLLM's OpenAI server does where the variable is set (by the operator, or by vLLM itself
    with ``--api-server-count`` above 1), and its proposer runs in the engine's process, whose
    metrics that server would otherwise never see. Counters are written as they grow (summed
    over processes), gauges as they stand (summed over live processes; a version, the newest)."""

    def __init__(self, collector: Collector, period_s: float = 1.0) -> None:
        if not self.available():
            raise RuntimeError("this process keeps no multiprocess metric values (PROMETHEUS_MULTIPROC_DIR unset)")
        self._collector = collector
        self._metrics: dict[str, Counter | Gauge] = {}
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.write()  # every series exists from the start
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="draftcache-metrics", daemon=True)
        self._thread.start()

    @staticmethod
    def available() -> bool:
        """Whether this process writes metric values to a multiprocess directory (decided by
        prometheus_client when first imported, from the environment)."""
        return values.ValueClass is not values.MutexValue

    def write(self) -> None:
        """Write every sample as the collector reads it now."""
        with self._lock:
            for family in self._collector.collect():
                for sample in family.samples:
                    self._write(family, sample)

    def _write(self, family: Metric, sample: Sample) -> None:
        if family.type == "counter" and sample.name == family.name + "_total":
            counter = self._metric(family, sample)
            assert isinstance(counter, Counter)
            key = (family.name, tuple(sorted(sample.labels.items())))
            grown = sample.value - self._totals.get(key, 0.0)
            child = counter.labels(**sample.labels)  # at 0 until it grows
            if grown > 0:
                child.inc(grown)
                self._totals[key] = sample.value
        elif family.type == "gauge":
            gauge = self._metric(family, sample)
            assert isinstance(gauge, Gauge)
            gauge.labels(**sample.labels).set(sample.value)

    def _metric(self, family: Metric, sample: Sample) -> Counter | Gauge:
        metric = self._metrics.get(family.name)
        if metric is None:
            labels = sorted(sample.labels)
            if family.type == "counter":  # registry=None: in this process's registry never
                metric = Counter(family.name, family.documentation, labels, registry=None)
            else:
                mode = _GAUGE_MODES.get(family.name, "livesum")
                metric = Gauge(family.name, family.documentation, labels, registry=None, multiprocess_mode=mode)  # type: ignore[arg-type]
            self._metrics[family.name] = metric
        return metric

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.write()
            except Exception:  # the engine's metrics, never the engine
                logger.exception("draftcache: client metrics not written")

    def close(self) -> None:
        """Stop, with the last values written (where they can be)."""
        self._stop.set()
        self._thread.join()
        try:
            self.write()
        except Exception:  # the engine's metrics, never the engine
            logger.exception("draftcache: client metrics not written")


def _mirrored(collector: Collector) -> MultiprocessMirror | None:
    """``collector`` mirrored where this process keeps multiprocess values; ``None`` where it
    keeps none, or where they cannot be written (logged: an engine does not stop for its
    metrics)."""
    if not MultiprocessMirror.available():
        return None
    where = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
    try:
        mirror = MultiprocessMirror(collector)
    except OSError as exc:  # the folder missing or not writable
        logger.error("draftcache: cannot write the client's metrics to %s: %s", where, exc)
        return None
    logger.info("draftcache: client metrics written to %s for the engine's own /metrics", where)
    return mirror


class ClientMetrics:
    """A collector's outlets until :meth:`close`: served over HTTP (``/metrics``) on a port of
    its own, and mirrored (:class:`MultiprocessMirror`) where this process keeps multiprocess
    values."""

    def __init__(self, collector: Collector, port: int = 0, host: str = "127.0.0.1") -> None:
        """``port`` 0: not served over HTTP (``OSError`` where it cannot be bound)."""
        self._server: WSGIServer | None = None
        self.port = 0
        if port:
            registry = CollectorRegistry()
            registry.register(collector)
            self._server, _ = start_http_server(port, addr=host, registry=registry)
            self.port = int(self._server.server_port)
        self._mirror = _mirrored(collector)

    @classmethod
    def serve(cls, collector: Collector, port: int, host: str = "127.0.0.1") -> ClientMetrics | None:
        """Served on ``port`` (0: not served) and mirrored where this process keeps multiprocess
        values; ``None`` where neither is. A port that cannot be bound is logged and left out:
        an engine does not stop for its metrics."""
        try:
            started = cls(collector, port, host)
        except OSError as exc:
            logger.error("draftcache: cannot serve the client's metrics on %s:%d: %s", host, port, exc)
            if not MultiprocessMirror.available():
                return None
            started = cls(collector)  # mirrored all the same
        else:
            if port:
                logger.info("draftcache: client metrics on http://%s:%d/metrics", host, started.port)
        return started if started.port or started._mirror is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._mirror is not None:
            self._mirror.close()

"""deploy/prometheus: the rules an operator loads (``alerts.yml``) and the Grafana dashboard
(``dashboard.json``). The rules and every dashboard query are checked by promtool, the rules'
unit tests (tests/deploy/alerts_test.yml) run, every metric and label value either reads is held
to what a real ``draftcache serve`` exports, and a real Prometheus scraping a real service
evaluates the rules and the dashboard's queries while the service's Redis is killed and started
again.

Prometheus and promtool are Debian's, unpacked by ``deploy/setup_prometheus.sh`` (``tests/run.sh``
sets ``$DRAFTCACHE_TEST_PROMETHEUS`` to their folder); without them those tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from deploy_files import DEPLOY, ROOT, compose
from draftcache.v1 import draftcache_pb2 as pb
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache_service.host.embedded_redis import free_port
from decoder_client.client import ClientConfig, ClientStats, DraftClient
from decoder_client.client.metrics import ClientCollector, ClientMetrics
from tests.faults import Serve, wait_for
from tests.service.test_redis_outage import Redis

RULES = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "prometheus" / "dashboard.json"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yml")
PROMETHEUS_ENV = "DRAFTCACHE_TEST_PROMETHEUS"
VOCAB = 1000
# A metric the rules read: a name outside a recorded series' name (those hold colons).
_METRIC = re.compile(r"(?<![\w:])draftcache_\w+")


@pytest.fixture(scope="module")
def tools() -> Path:
    """The folder holding ``prometheus`` and ``promtool``."""
    named = os.environ.get(PROMETHEUS_ENV)
    folder = Path(named) if named else ROOT / ".venv" / "prometheus" / "bin"
    if not (folder / "promtool").is_file() or not (folder / "prometheus").is_file():
        pytest.skip(f"no prometheus and promtool in {folder} (${PROMETHEUS_ENV}; bash deploy/setup_prometheus.sh)")
    return folder


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_the_dashboard_is_laid_out_and_reads_its_prometheus_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs), p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" and t["expr"] for t in p["targets"]), p["title"]
    # The rules' recorded series are what the dashboard plots where it can.
    records = {r["record"] for r in _rules() if "record" in r}
    assert records <= set(_dashboard_queries())


def test_promtool_parses_every_dashboard_query(tools: Path, tmp_path: Path) -> None:
    queries = _dashboard_queries()
    as_rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": q} for i, q in enumerate(queries)]}
        ]
    }
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump(as_rules))
    done = subprocess.run([tools / "promtool", "check", "rules", path], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_checks_the_rules(tools: Path) -> None:
    done = subprocess.run([tools / "promtool", "check", "rules", RULES], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_the_compose_prometheus_config_loads_the_rules(tools: Path) -> None:
    """deploy/prometheus/prometheus.yml, which Compose mounts beside the rules: promtool reads it
    and the rule file it names, as Prometheus will."""
    config = DEPLOY / "prometheus" / "prometheus.yml"
    done = subprocess.run([tools / "promtool", "check", "config", config], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout and f"SUCCESS: {len(_rules())} rules found" in done.stdout
    service = compose()["services"]["prometheus"]
    mounts = {v.split(":")[1]: DEPLOY / v.split(":")[0] for v in service["volumes"] if v.startswith("./")}
    assert mounts == {"/etc/prometheus/prometheus.yml": config, "/etc/prometheus/alerts.yml": RULES}
    assert "--config.file=/etc/prometheus/prometheus.yml" in service["command"]
    assert service["profiles"] == ["monitoring"]


def test_the_rules_unit_tests_pass(tools: Path) -> None:
    done = subprocess.run(
        [tools / "promtool", "test", "rules", UNIT_TESTS.name], cwd=UNIT_TESTS.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Every alert is tested, firing and quiet.
    tested = re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text())
    assert {r["alert"] for r in _rules() if "alert" in r} <= set(tested)


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The service's exposition: sample name -> its (labels, value) pairs."""
    return _samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _requests(client: DraftClient, requests: int, *, wait: bool = True) -> None:
    """Requests that repeat their prompt, drafted for and verified step by step, then committed."""
    for r in range(requests):
        text = [(7 * r + i) % VOCAB for i in range(40)]
        sessions = client.open([text + text[:8]], wait=wait)
        client.draft(sessions, [[]])
        for at in range(8, 40, 4):  # the prompt's own text, 4 tokens a step: its drafts are accepted
            client.draft(sessions, [text[at : at + 4]])
        client.close(sessions, commit=True)


def _client(target: str, *, stream: bool = True, deadline_s: float = 2.0) -> DraftClient:
    return DraftClient(
        ClientConfig(target=target, namespace="ns", vocab_size=VOCAB, deadline_s=deadline_s, stream=stream)
    )


def _traffic(target: str, *, stream: bool, requests: int = 3) -> ClientStats:
    """:func:`_requests` from a client of their own; its counts."""
    client = _client(target, stream=stream)
    try:
        _requests(client, requests)
    finally:
        client.shutdown()
    return client.stats


def _refused_open(serve: Serve) -> None:
    """An open stating another vocabulary (another tokenizer's model): FAILED_PRECONDITION."""
    request = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns", prompt=[1, 2], vocab_size=2 * VOCAB)])
    with pytest.raises(grpc.RpcError) as refused:
        serve.stub.OpenSessions(request, timeout=10)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def _start(data: Path, metrics: int, redis_url: str | None = None) -> Serve:
    serve = Serve(data, "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1", redis_url=redis_url).start()
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name="ns", vocab_size=VOCAB))
    return serve


def test_every_metric_and_label_the_rules_read_is_what_a_real_service_exports(tmp_path: Path) -> None:
    metrics = free_port()
    with contextlib.closing(_start(tmp_path / "data", metrics)) as serve:
        target = f"127.0.0.1:{serve.port}"
        _traffic(target, stream=True)
        client = _traffic(target, stream=False)
        _refused_open(serve)
        serve.admin.Rebuild(pb.RebuildRequest(namespace="ns"), timeout=60)
        time.sleep(3)  # idle: nothing waits to be written back
        samples = _scrape(metrics)
    # An engine's client serves its own (decoder_client.client.metrics): the rules read those too.
    registry = CollectorRegistry()
    registry.register(ClientCollector(lambda: client, namespace="ns", engine="test"))
    engine_samples = _samples(generate_latest(registry).decode())
    assert {labels["source"] for labels, _ in engine_samples["draftcache_client_drafts_total"]} == {
        "service",
        "near",
        "fallback",
    }
    for what, queries in (("rules", [r["expr"] for r in _rules()]), ("dashboard", _dashboard_queries())):
        read = {name for q in queries for name in _METRIC.findall(q)}
        assert read, f"no metric found in the {what}"
        engines = {n for n in read if n.startswith("draftcache_client_")}
        served = read - engines
        assert served <= set(samples), f"the {what} read metrics the service does not export: {served - set(samples)}"
        assert engines <= set(engine_samples), f"the {what} read client metrics none exports: {engines}"
    # The label values the rules select by: draft calls unary and on the stream, a refusal's code.
    calls = {(labels["method"], labels["code"]) for labels, _ in samples["draftcache_rpc_seconds_count"]}
    assert {("Draft", "OK"), ("Stream.draft", "OK"), ("OpenSessions", "FAILED_PRECONDITION")} <= calls
    draft_methods = next(r for r in _rules() if r.get("record") == "instance:draftcache_draft_seconds:p99_5m")
    pattern = re.search(r'method=~"([^"]+)"', draft_methods["expr"])
    assert pattern is not None
    drafts = re.compile(pattern.group(1).replace("\\\\", "\\"))
    assert {m for m, _ in calls if drafts.fullmatch(m)} == {"Draft", "Stream.draft"}
    assert {labels["namespace"] for labels, _ in samples["draftcache_accepted_tokens_total"]} == {"ns"}
    # Session state idle and written back: its age stays near the write-back period (an idle
    # replica is not "behind"; DraftcacheSessionsNotSaved reads it).
    ((_, age),) = samples["draftcache_session_save_age_seconds"]
    assert age < 2.0


class Prometheus:
    """A real Prometheus scraping ``targets`` every second and evaluating ``rules`` as often."""

    def __init__(self, binary: Path, workdir: Path, rules: Path, targets: dict[str, int]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for job, port in targets.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        args = [str(binary), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}"]
        args.append(f"--web.listen-address={self.url.removeprefix('http://')}")
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 60, f"Prometheus to be ready (log: {self.log})", every_s=0.2)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as r:
            answer = json.loads(r.read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        return [(s["metric"], float(s["value"][1])) for s in self.api("query", query=promql)["result"]]

    def alerts(self, name: str, state: str) -> list[dict[str, str]]:
        return [labels for labels, _ in self.query(f'ALERTS{{alertname="{name}", alertstate="{state}"}}')]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def _prometheus(binary: Path, workdir: Path, targets: dict[str, int]) -> Iterator[Prometheus]:
    prometheus = Prometheus(binary, workdir, RULES, targets)
    try:
        yield prometheus
    finally:
        prometheus.close()


def test_a_real_prometheus_evaluates_the_rules_on_a_real_service_and_client_through_outages(
    tmp_path: Path, tools: Path
) -> None:
    """Prometheus scrapes the service and an engine's client (its counts served as an engine
    integration serves them). The rules evaluate, the recorded figures are the service's, and
    each fault raises its alert: a refused client at once; Redis killed, the storage alert
    (pending: it fires after 1 m); the service frozen, the client's steps fall back and the
    fallback alert is pending. Each clears when the fault ends."""
    redis = Redis(tmp_path)
    redis.start()
    metrics, client_metrics = free_port(), free_port()
    serve = _start(tmp_path / "data", metrics, redis_url=redis.url)
    target = f"127.0.0.1:{serve.port}"
    engine = _client(target, deadline_s=0.2)
    served = ClientMetrics(ClientCollector(lambda: engine.stats, namespace="ns", engine="test"), client_metrics)
    try:
        targets = {"draftcache": metrics, "engines": client_metrics}
        with _prometheus(tools / "prometheus", tmp_path / "prometheus", targets) as prom:
            wait_for(lambda: len(prom.query("up == 1")) == 2, 30, "the first scrapes")
            deadline = time.monotonic() + 4  # over several scrapes: the rates need two samples apart
            while time.monotonic() < deadline:
                _requests(engine, 1)
            # The rules evaluate without error, and the recorded figures are the service's.
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            assert len(rules) == len(_rules())
            healthy = lambda: all(r["health"] == "ok" for g in prom.api("rules")["groups"] for r in g["rules"])  # noqa: E731
            wait_for(healthy, 10, "every rule evaluated without error")
            per_step = 'namespace:draftcache_accepted_tokens_per_step:rate5m{namespace="ns"}'
            wait_for(lambda: [v for _, v in prom.query(per_step) if v > 0], 30, "accepted tokens per step recorded")
            p99 = "instance:draftcache_draft_seconds:p99_5m"
            wait_for(lambda: [v for _, v in prom.query(p99) if math.isfinite(v) and v > 0], 30, "draft p99 recorded")
            assert not prom.query("ALERTS")
            # Every dashboard query evaluates (an error would fail the call), most to series already.
            answered = [bool(prom.query(q)) for q in _dashboard_queries()]
            assert sum(answered) >= len(answered) - 2, answered
            share = 'sum by (namespace) (rate(draftcache_client_drafts_total{source="fallback"}[5m]))'
            assert prom.query(share) == [({"namespace": "ns"}, 0.0)]
            # A client of another tokenizer, refused once: the alert fires at once.
            _refused_open(serve)
            wait_for(lambda: prom.alerts("DraftcacheCallsRefused", "firing"), 30, "DraftcacheCallsRefused")
            (fired,) = prom.alerts("DraftcacheCallsRefused", "firing")
            assert fired["method"] == "OpenSessions" and fired["code"] == "FAILED_PRECONDITION"
            # Redis killed: a commit goes to the journal, and the outage is pending (for 1 m).
            redis.kill()
            _requests(engine, 1)  # its close, with commit, lands in the background
            wait_for(lambda: serve.stats().storage.journaled_commits >= 1, 30, "a commit journaled")
            wait_for(lambda: prom.alerts("DraftcacheStorageDown", "pending"), 30, "DraftcacheStorageDown pending")
            assert prom.query("draftcache_journal_commits > 0")
            # Redis back: the journal drains and the alert is gone.
            redis.start()
            wait_for(lambda: serve.stats().storage.journaled_commits == 0, 30, "the journal to drain")
            wait_for(lambda: not prom.alerts("DraftcacheStorageDown", "pending"), 30, "the outage to clear")
            assert prom.query("draftcache_storage_up == 1")
            # The service frozen: the engine's steps draft locally, never waiting past the
            # deadline, and the fallback alert is pending (it fires after 10 m).
            serve.freeze()
            try:
                fallback, service = engine.stats.fallback, engine.stats.remote
                began = time.monotonic()
                while time.monotonic() - began < 1.5:  # local steps are quick: more than before it froze
                    _requests(engine, 1, wait=False)
                assert time.monotonic() - began < 3  # no step waited past its deadline for long
                assert engine.stats.fallback - fallback > service and engine.stats.remote == service
                wait_for(lambda: prom.alerts("DraftcacheClientsFallingBack", "pending"), 30, "fallback alert")
            finally:
                serve.thaw()
    finally:
        served.close()
        engine.shutdown()
        serve.close()
        redis.kill()

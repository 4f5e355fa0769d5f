"""vLLM's OpenAI-compatible server serves draftcache's client counts on its own /metrics when
it collects prometheus_client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR`` set, as an
operator sets it, or as vLLM does with several API servers): the proposer runs in vLLM's engine
process and writes its counts there. One real server, one request (about a minute and a half)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.engines.vllm.conftest import NAMESPACE
from tests.engines.vllm.test_openai_replicas import QUESTION, ApiServer
from tests.faults import Serve, wait_for


def test_the_servers_own_metrics_carry_the_proposers_counts(model_folder: Path, serve: Serve, tmp_path: Path) -> None:
    folder = tmp_path / "prometheus"
    folder.mkdir()
    namespace = f"{NAMESPACE}-server-metrics"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(folder)}
    server = ApiServer(model_folder, serve.port, 0, tmp_path / "vllm.log", True, namespace, env=env)
    try:
        wait_for(server.ready, 900, "a vLLM server to be ready", every_s=1.0)
        server.chat(QUESTION, model_folder, 64)
        before = server.spec_counters()
        server.chat(QUESTION, model_folder, 64)  # asked again: drafted from the first answer
        after = server.spec_counters()

        def drafts() -> dict[str, float]:
            return {
                s.labels["source"]: s.value
                for family in text_string_to_metric_families(server.metrics())
                for s in family.samples
                if s.name == "draftcache_client_drafts_total"
                and s.labels == {"engine": "vllm", "namespace": namespace, "source": s.labels["source"]}
            }

        # The proposer's mirror writes every second.
        wait_for(lambda: drafts().get("near", 0) > 0, 30, "the proposer's counts on the server's /metrics")
        seen = drafts()
        assert seen["near"] > 0 and seen["service"] == 0, seen
        assert after["num_accepted_tokens"] > before.get("num_accepted_tokens", 0)  # vLLM's own, beside them
        text = server.metrics()
        assert "draftcache_client_commits_dropped_total" in text and "draftcache_client_near_prior_version" in text
    finally:
        server.stop()

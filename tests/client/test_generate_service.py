"""``draftcache generate --target``'s drafter: the reference decoder drafting through a real
service, the target's top-k at every node it verified sent back over the wire."""

from __future__ import annotations

from benchmarks.generate import ServiceDrafter, run_generate
from benchmarks.service_admin import ensure_namespace
from cache_service.config import ServiceConfig
from decoder_client.client import ClientConfig
from indexer.drafter import DraftParams
from indexer.successors import MAX_TOPK
from indexer.tokens import Namespace
from tests.service.conftest import start_service, stop_service

PROMPT = "Repeat exactly: alpha beta gamma delta. Then repeat it again: alpha beta gamma delta."


def test_every_verified_nodes_row_reaches_the_services_successor_table(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    running = start_service(ServiceConfig())
    try:
        ensure_namespace(running.target, Namespace(name="generate", vocab_size=len(tokenizer)))
        params = DraftParams(budget=16)  # a second's deadline: no call falls back on a loaded machine
        config = ClientConfig(target=running.target, namespace="generate", params=params, topk=MAX_TOPK, deadline_s=1.0)
        drafter = ServiceDrafter(config)
        result = run_generate(model, tokenizer, PROMPT, drafter, max_new_tokens=24, cost_aware=False)
        drafter.finish()
        assert result["identical"]  # the same tokens as greedy decoding
        ours = result["draftcache"]
        steps = round(len(ours["tokens"]) / ours["mat"])
        # Every step but the last sent its rows with the next call: the root's and every node's,
        # more than the tokens the steps produced (the nodes the target rejected count too).
        table = running.service.namespace("generate").successors
        assert table.observations > len(ours["tokens"]) and steps > 1
        assert drafter._client.stats.fallback == 0
    finally:
        stop_service(running)

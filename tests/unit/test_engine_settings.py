"""EngineSettings: an engine's own configuration first, then DRAFTCACHE_*, each value checked."""

from __future__ import annotations

import pytest

from decoder_client.engines.settings import EngineSettings


def test_engine_config_wins_over_the_environment() -> None:
    env = {"DRAFTCACHE_NAMESPACE": "from-env", "DRAFTCACHE_TARGET": "env:1", "DRAFTCACHE_DEADLINE_S": "0.02"}
    s = EngineSettings.from_sources({"namespace": "from-engine"}, env)
    assert (s.namespace, s.target, s.deadline_s) == ("from-engine", "env:1", 0.02)


def test_environment_strings_take_each_field_type() -> None:
    env = {
        "DRAFTCACHE_NAMESPACE": "ns",
        "DRAFTCACHE_BUDGET": "32",
        "DRAFTCACHE_CREATE_NAMESPACE": "false",
        "DRAFTCACHE_CHAIN_MIN_PROB": "0.1",
    }
    s = EngineSettings.from_sources(None, env)
    assert (s.budget, s.create_namespace, s.chain_min_prob) == (32, False, 0.1)


def test_defaults() -> None:
    s = EngineSettings.from_sources({"namespace": "ns"}, {})
    assert s.target == "127.0.0.1:50051" and s.token == "" and s.create_namespace


def test_a_continued_chains_rest_must_fill_what_the_engine_takes_unless_told_otherwise() -> None:
    service = {"namespace": "ns", "near": False}  # chains continue only when drafted by the service
    config = EngineSettings.from_sources(service, {}).client_config(24)
    assert (config.params.chain, config.chain_take) == (32, 24)  # asked 8 longer, the rest must fill 24
    assert EngineSettings.from_sources({**service, "chain_take": 0}, {}).client_config(24).chain_take == 0
    assert EngineSettings.from_sources({**service, "chain_take": 40}, {}).client_config(24).chain_take == 32
    off = EngineSettings.from_sources({**service, "continue_chains": False}, {}).client_config(24)
    assert (off.params.chain, off.chain_take) == (24, 0)
    # Drafting near (the default), a chain is drafted at every step: nothing to continue.
    near = EngineSettings.from_sources({"namespace": "ns"}, {}).client_config(24)
    assert (near.params.chain, near.chain_take, near.continue_chains) == (24, 0, False)


def test_max_batch_reaches_the_client_and_is_checked() -> None:
    service = {"namespace": "ns", "near": False}
    assert EngineSettings.from_sources(service, {}).client_config(4).max_batch == 256  # serve --max-batch's default
    assert EngineSettings.from_sources(service, {"DRAFTCACHE_MAX_BATCH": "16"}).client_config(4).max_batch == 16
    for bad in (0, 4097):
        with pytest.raises(ValueError, match=f"max_batch must be in \\[1, 4096\\], got {bad}"):
            EngineSettings.from_sources({**service, "max_batch": bad}, {})


@pytest.mark.parametrize("k", [0, 129])
def test_the_engines_speculative_tokens_are_checked_against_what_a_draft_holds(k: int) -> None:
    with pytest.raises(ValueError, match=f"num_speculative_tokens is {k}"):
        EngineSettings.from_sources({"namespace": "ns"}, {}).client_config(k)


@pytest.mark.parametrize(
    ("engine", "env", "message"),
    [
        ({}, {}, "needs a namespace"),
        ({"namespace": "ns", "deadline": 1}, {}, "unknown draftcache settings"),
        ({"namespace": "ns", "budget": "many"}, {}, "budget must be an integer"),
        ({"namespace": "ns", "budget": 2.5}, {}, "budget must be an integer"),
        ({"namespace": "ns", "create_namespace": "maybe"}, {}, "create_namespace must be a boolean"),
        ({"namespace": "ns", "deadline_s": True}, {}, "deadline_s must be a number"),
        ({"namespace": 7}, {}, "namespace must be a string"),
        ({"namespace": "ns", "deadline_s": 0}, {}, "must be > 0"),
        ({"namespace": "ns"}, {"DRAFTCACHE_BUDGET": "-1"}, "budget must be in"),
        ({"namespace": "ns", "chain_min_prob": 1.5}, {}, "chain_min_prob must be in"),
        ({"namespace": "ns", "chain_take": -2}, {}, "chain_take must be >= 0"),
        # Neither a traceback from int() or float() nor a value no range check catches.
        ({"namespace": "ns", "budget": None}, {}, "budget must be an integer, got None"),
        ({"namespace": "ns", "deadline_s": [0.01]}, {}, "deadline_s must be a number"),
        ({"namespace": "ns", "retry_after_s": float("nan")}, {}, "retry_after_s must be a finite number"),
        ({"namespace": "ns"}, {"DRAFTCACHE_STATS_EVERY_S": "nan"}, "stats_every_s must be a finite number"),
        ({"namespace": "ns", "deadline_s": float("inf")}, {}, "deadline_s must be a finite number"),
        ({"namespace": "ns", "near_follow_s": float("inf")}, {}, "near_follow_s must be a finite number"),
        # gRPC takes any target and fails (or reaches another port) at every call.
        ({"namespace": "ns", "target": ""}, {}, "target must be HOST:PORT"),
        ({"namespace": "ns", "target": "http://cache:50051"}, {}, "target must be HOST:PORT"),
        ({"namespace": "ns", "target": "cache"}, {}, "target must be HOST:PORT"),
        ({"namespace": "ns"}, {"DRAFTCACHE_TARGET": "127.0.0.1:99999"}, "target must be HOST:PORT"),
        ({"namespace": "ns", "target": "cache :50051"}, {}, "target must be HOST:PORT"),
    ],
)
def test_bad_settings_are_refused(engine: dict[str, object], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineSettings.from_sources(engine, env)


@pytest.mark.parametrize(
    "target", ["127.0.0.1:50051", "cache.internal:1", "[::1]:50051", "unix:/run/dc.sock", "dns:///cache:50051"]
)
def test_targets_grpc_reaches_are_taken(target: str) -> None:
    assert EngineSettings.from_sources({"namespace": "ns", "target": target}, {}).target == target

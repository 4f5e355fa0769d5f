"""draftcache as llama.cpp's draft model, in the real engine (llama-cpp-python on SmolLM2) with a
real ``draftcache serve``: the deltas and drafts it hands the engine, its commits, the fleet's
memory across replicas, and a service killed or frozen mid-generation."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.engines_llamacpp import greedy
from cache_service.host.embedded_redis import free_port
from decoder_client.client import ClientConfig, DraftClient, TopkAt
from decoder_client.client.session import TopkRows
from decoder_client.engines.llamacpp import DraftcacheDraftModel
from indexer.drafter import DraftParams
from indexer.tree_builder import DraftTree
from tests.engines.llamacpp.conftest import NAMESPACE, QUESTIONS, chat_ids, start_serve
from tests.faults import Serve, log_entries, wait_for

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[llamacpp]'")

K = 10


class Recording:
    """A draft model with every call kept: the sequence it got and the draft it gave."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        draft = self.inner(input_ids)
        self.calls.append((np.asarray(input_ids).tolist(), np.asarray(draft).tolist()))
        return draft


class Traced(DraftcacheDraftModel):
    """Ours, with each call kept: the sequence's length, the draft and the call's duration."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, list[int], float]] = []

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> np.ndarray:
        start = time.perf_counter()
        draft = super().__call__(input_ids)
        self.calls.append((len(input_ids), draft.tolist(), time.perf_counter() - start))
        return draft


def _engines_lookup(context: np.ndarray, budget: int) -> DraftTree:
    """llama.cpp's own prompt lookup (its defaults: bigrams), as the client's local drafter."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    found = LlamaPromptLookupDecoding.find_candidate_pred_tokens(context, 2, budget)
    return DraftTree.chain(np.asarray(found, dtype=np.int32))


def _accepted(calls: list[tuple[list[int], list[int]]]) -> int:
    """Draft tokens the engine kept, read off consecutive calls of one generation: the next
    sequence's new tokens start with them."""
    total = 0
    for (seq, draft), (after, _) in itertools.pairwise(calls):
        if after[: len(seq)] != seq:  # another generation
            continue
        new = after[len(seq) :]
        kept = [d == t for d, t in zip(draft, new, strict=False)]
        total += kept.index(False) if False in kept else len(kept)
    return total


def _entry(serve: Serve, prompt: list[int]) -> list[int] | None:
    """The lifetime log's request that starts with ``prompt``, if any."""
    found = [e for e in log_entries(serve.redis_url(), NAMESPACE) if e[: len(prompt)] == prompt]
    assert len(found) <= 1, found
    return found[0] if found else None


def _target(serve: Serve) -> str:
    return f"127.0.0.1:{serve.port}"


def test_with_the_service_down_it_drafts_and_decodes_as_the_engines_prompt_lookup(make_llama) -> None:  # type: ignore[no-untyped-def]
    """Nothing listens at the target, and the client's fallback is the engine's own prompt
    lookup: every call must then see the same sequence and give the same draft as
    ``LlamaPromptLookupDecoding`` does in a second engine, which only holds if the session
    got exactly the engine's sequence through the deltas. Identical drafts, identical output."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    config = ClientConfig(target=f"127.0.0.1:{free_port()}", namespace=NAMESPACE, params=DraftParams(chain=K))
    model = DraftcacheDraftModel(DraftClient(config, fallback=_engines_lookup), num_pred_tokens=K)
    ours, theirs = Recording(model), Recording(LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=K))
    ours_llm, theirs_llm = make_llama(ours), make_llama(theirs)
    for question in QUESTIONS:
        ids = chat_ids(ours_llm, question)
        assert greedy(ours_llm, ids, 48) == greedy(theirs_llm, ids, 48), question
    assert ours.calls == theirs.calls
    assert model.client.stats.remote == 0 and model.client.stats.fallback == len(ours.calls)
    assert model.stats.generations == len(QUESTIONS)
    # Its own count of accepted drafts is what the engine kept (and drafts did get accepted).
    assert model.stats.accepted == _accepted(theirs.calls) > 0
    # The outcomes that correct the chances count the same drafts.
    chains = model.outcomes.summary()
    assert (chains["proposed_tokens"], chains["accepted_tokens"]) == (model.stats.proposed, model.stats.accepted)
    assert all(len(draft) <= K for _, draft in ours.calls)
    model.close()


def test_an_attached_model_evaluates_a_prompt_for_its_last_logits_alone(make_llama) -> None:  # type: ignore[no-untyped-def]
    """By default an attached engine computes no logits for a prompt's positions but its last,
    which it keeps where the engine does (the row the top-k write-back and stopping criteria
    read); decoding is unchanged: the same drafts (the service down, the engine's own lookup
    answering) and the same tokens. ``prompt_logits=True`` keeps them all."""
    models, llms = [], []
    for keep in (False, True):
        config = ClientConfig(target=f"127.0.0.1:{free_port()}", namespace=NAMESPACE, params=DraftParams(chain=K))
        model = Traced(DraftClient(config, fallback=_engines_lookup), num_pred_tokens=K)
        models.append(model)
        llms.append(model.attach(make_llama(model), prompt_logits=keep))
    ids = chat_ids(llms[0], QUESTIONS[0])
    n = len(ids)
    for llm in llms:  # the engine allocates its logits buffer uninitialised: mark what was never written
        llm.scores[:n] = np.nan
    outs = [greedy(llm, ids, 32) for llm in llms]
    assert outs[0] == outs[1]
    assert [c[:2] for c in models[0].calls] == [c[:2] for c in models[1].calls]
    lean, full = (llm.scores for llm in llms)
    # The prompt's other positions: none computed by the lean engine, all by the full one.
    assert np.isnan(lean[: n - 1]).all() and np.isfinite(full[:n]).all()
    np.testing.assert_allclose(lean[n - 1], full[n - 1], rtol=1e-4, atol=1e-4)
    assert int(np.argmax(lean[n - 1])) == outs[0][0]  # the first token came from that row
    # Later generations on the same engine: the prompt reused from its cache, or evaluated afresh.
    again = [greedy(llm, ids, 8) for llm in llms]
    assert again[0] == again[1] == outs[0][:8]
    for model in models:
        model.close()


def test_an_attached_generation_reaches_the_lifetime_log_whole(serve: Serve, make_llama) -> None:  # type: ignore[no-untyped-def]
    """Through the engine's own completion call: the log gets the prompt and every generated
    token, the last step's included, as soon as the completion returns."""
    draft = DraftcacheDraftModel.connect(_target(serve), NAMESPACE, num_pred_tokens=K, deadline_s=0.05, near=False)
    llm = draft.attach(make_llama(draft))
    ids = chat_ids(llm, QUESTIONS[2])
    done = llm.create_completion(prompt=ids, max_tokens=24, temperature=0.0)
    n = done["usage"]["completion_tokens"]
    wait_for(lambda: _entry(serve, ids) is not None, 10, "the generation in the lifetime log")
    entry = _entry(serve, ids)
    assert entry is not None and len(entry) - len(ids) in (n, n + 1)  # + the end-of-text token, if it ended so
    assert llm.detokenize(entry[len(ids) : len(ids) + n]).decode() == done["choices"][0]["text"]
    assert draft.stats.generations == 1 and draft.client.stats.remote > 0
    draft.close()


def test_without_attach_a_generation_is_committed_when_the_next_one_starts(serve: Serve, make_llama) -> None:  # type: ignore[no-untyped-def]
    """A plain ``Llama``: the next generation's first call ends the previous one (all but its
    last step's tokens); ``close`` ends the last."""
    draft = DraftcacheDraftModel.connect(_target(serve), NAMESPACE, num_pred_tokens=K, deadline_s=0.05, near=False)
    llm = make_llama(draft)
    first, second = chat_ids(llm, QUESTIONS[1]), chat_ids(llm, QUESTIONS[0])
    whole = first + greedy(llm, first, 24)
    time.sleep(0.5)
    assert _entry(serve, first) is None  # nothing has told it the generation ended
    greedy(llm, second, 24)
    wait_for(lambda: _entry(serve, first) is not None, 10, "the first generation in the log")
    entry = _entry(serve, first)
    assert entry is not None and entry == whole[: len(entry)] and len(entry) >= len(whole) - (K + 1)
    draft.close()
    wait_for(lambda: _entry(serve, second) is not None, 10, "the second generation in the log")
    assert draft.stats.generations == 2


class TopkRecorded(DraftcacheDraftModel):
    """Ours, with the top-k rows it sent kept, beside the sequence each call saw, its new tokens
    and the draft its step had verified."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[tuple[list[int], list[int], list[int], TopkRows]] = []

    def verified_topk(self, ids: np.ndarray, new: np.ndarray, draft: np.ndarray | None) -> TopkRows:
        rows = super().verified_topk(ids, new, draft)
        self.rows.append((ids.tolist(), new.tolist(), [] if draft is None else draft.tolist(), rows))
        return rows


def test_the_engines_own_top_k_goes_back_to_the_service(serve: Serve, make_llama) -> None:  # type: ignore[no-untyped-def]
    """With ``topk``: a row at every position a step verified, each after the token there: the
    token before the new ones, then every token of the draft, rejected ones included. Where a
    row produced a token, that token is its top-1 (the rows are the engine's own distributions,
    read from its logits); the service's successor table, shared through Redis, fills from them."""
    import redis

    from cache_service.storage import keys

    draft = TopkRecorded.connect(_target(serve), NAMESPACE, num_pred_tokens=K, deadline_s=0.05, topk=8, near=False)
    llm = draft.attach(make_llama(draft))
    greedy(llm, chat_ids(llm, QUESTIONS[2]), 32)  # an answer not copied from the prompt: many steps
    assert len(draft.rows) >= 4  # steps that reported tokens (how many depends on what was accepted)
    rejected = 0
    for seen, new, verified, sent in draft.rows:
        before = len(seen) - len(new)  # where the new tokens start
        if not verified:  # no draft verified: a row per new token, the one that produced it
            rows = np.asarray(sent).tolist()
            assert [r[0] for r in rows] == new and all(len(set(r)) == 8 for r in rows)
            continue
        assert isinstance(sent, TopkAt)
        after, rows = list(sent.after), np.asarray(sent.rows).tolist()
        assert after == [seen[before - 1], *verified] and len(rows) == len(after)
        assert all(len(set(r)) == 8 for r in rows)
        assert [r[0] for r in rows[: len(new)]] == new  # the rows that produced the new tokens
        accepted = len(new) - 1  # the draft tokens kept, then the engine's own
        assert verified[:accepted] == new[:accepted]
        if accepted < len(verified):
            assert verified[accepted] != new[accepted]
        rejected += len(verified) - accepted  # positions past the first rejection: rows sent too
    assert rejected > 0
    client = redis.Redis.from_url(serve.redis_url())
    wait_for(lambda: client.hlen(keys.successors(NAMESPACE)) > 0, 20, "successor rows in storage")
    client.close()
    draft.close()


def test_a_request_the_fleet_has_seen_is_drafted_further_on_another_replica(serve: Serve, make_llama) -> None:  # type: ignore[no-untyped-def]
    """Two engines, one service: replica B, asked what replica A answered, is drafted A's answer
    from the fleet's memory at once and needs far fewer steps."""
    # Chains as long as the service made them (no cut for cost): the test is about what B is
    # drafted, not how much of it a CPU should verify.
    uncut = {"deadline_s": 0.05, "token_cost": 0.0, "chain_min_prob": 0.0, "near": False}
    a = DraftcacheDraftModel.connect(_target(serve), NAMESPACE, num_pred_tokens=K, **uncut)
    b = Traced.connect(_target(serve), NAMESPACE, num_pred_tokens=K, **uncut)
    llm_a, llm_b = a.attach(make_llama(a)), b.attach(make_llama(b))
    ids = chat_ids(llm_a, "Count from 1 to 30, separated by commas.")
    out = greedy(llm_a, ids, 64)
    wait_for(lambda: _entry(serve, ids) is not None, 10, "replica A's generation in the log")
    greedy(llm_b, ids, 64)
    assert len(out) > 32  # an answer long enough to draft
    length, first, _ = b.calls[0]  # after the prompt and one token: the K tokens A produced next
    assert first == out[length - len(ids) : length - len(ids) + K]
    assert b.stats.mean_accepted_tokens > a.stats.mean_accepted_tokens + 2, (a.stats, b.stats)
    a.close()
    b.close()


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_the_service_failing_mid_generation_does_not_stall_decoding(  # type: ignore[no-untyped-def]
    tmp_path: Path, vocab_size: int, make_llama, fault: str
) -> None:
    """SIGKILL, or SIGSTOP (its port still takes calls, nothing answers them), to ``draftcache
    serve`` after a few tokens: every later step is drafted locally within milliseconds and the
    generation runs to its end."""
    serve = start_serve(tmp_path / "data", vocab_size)
    redis = serve.redis_pid()
    try:
        draft = Traced.connect(_target(serve), NAMESPACE, num_pred_tokens=K, deadline_s=0.01, near=False)
        llm = draft.attach(make_llama(draft))
        out: list[int] = []
        killed_at = 0
        steps = llm.generate(chat_ids(llm, QUESTIONS[0]), temp=0.0)
        for token in steps:
            out.append(token)
            if len(out) == 12:
                (serve.sigkill if fault == "killed" else serve.freeze)()
                killed_at = len(draft.calls)
            if len(out) >= 64:
                break
        steps.close()
    finally:
        serve.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(redis, signal.SIGKILL)
    assert len(out) >= 64
    assert draft.client.stats.remote > 0 and draft.client.stats.fallback > 0
    after = [seconds for _, _, seconds in draft.calls[killed_at:]]
    assert after and max(after) < 0.5, after  # a stall would wait out a 1 s control timeout, or for ever
    draft.close()


# Spec-Bench-like first turns whose greedy answers part from a batched verification's without
# flash attention (checked with the engine made without it: the first test below then fails).
TIE_QUESTIONS = (
    *QUESTIONS,
    "Explain what a hash table is and when to use one.",
    "Translate into French: The weather is nice today, so we will walk to the market.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What is 17 times 23? Show the steps.",
)


def test_with_flash_attention_the_drafted_output_is_plain_greedys(serve: Serve, make_llama, vocab_size: int) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp verifies a draft in one batch. Without flash attention its CPU backend
    multiplies a batch's queries with the cached keys by another kernel than a one-token step's,
    which rounds otherwise, and greedy choices at near ties part from plain decoding's (the
    engine's own prompt lookup kept plain's output on 2 of 12 Spec-Bench first turns). With it,
    every output drafted by draftcache, chains uncut so that many go, is plain greedy's token
    for token, a question asked again (drafted whole from the near copy's memory) included."""
    plain = make_llama()
    draft = DraftcacheDraftModel.connect(
        _target(serve), NAMESPACE, num_pred_tokens=K, vocab_size=vocab_size, near_start_s=0,
        token_cost=0.0, chain_min_prob=0.0,
    )  # fmt: skip
    llm = draft.attach(make_llama(draft))
    for question in TIE_QUESTIONS:
        ids = chat_ids(plain, question)
        expected = greedy(plain, ids, 64)
        assert greedy(llm, ids, 64) == expected, question
        assert greedy(llm, ids, 64) == expected, question
    assert draft.stats.accepted > 200 and draft.stats.proposed > draft.stats.accepted, draft.stats
    draft.close()


def test_attaching_a_llama_without_flash_attention_warns(make_llama, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    from decoder_client.engines.llamacpp import flash_attention_off

    config = ClientConfig(target=f"127.0.0.1:{free_port()}", namespace=NAMESPACE, params=DraftParams(chain=K))
    with_fa, without = (DraftcacheDraftModel(DraftClient(config), num_pred_tokens=K) for _ in range(2))
    with caplog.at_level(logging.WARNING, logger="decoder_client.engines.llamacpp"):
        with_fa.attach(make_llama(with_fa))
        assert not caplog.records
        llm = without.attach(make_llama(without, flash_attn=False))
    assert flash_attention_off(llm)
    assert [r.getMessage() for r in caplog.records if "flash_attn=True" in r.getMessage()], caplog.text
    with_fa.close()
    without.close()


def test_a_near_copy_drafts_in_the_engine_and_commits_to_the_log(serve: Serve, make_llama, vocab_size: int) -> None:  # type: ignore[no-untyped-def]
    """Drafting near (the default): every draft is made in this process (no draft call), a
    question asked again is drafted from the generation the near copy finished, and each
    generation still reaches the service's lifetime log whole."""
    uncut = {"token_cost": 0.0, "chain_min_prob": 0.0}
    # Started empty: the service's log holds other tests' answers to this question, which a near
    # copy would read at start (tests/service/test_read_log.py covers that).
    draft = DraftcacheDraftModel.connect(
        _target(serve), NAMESPACE, num_pred_tokens=K, vocab_size=vocab_size, near_start_s=0, **uncut
    )
    llm = draft.attach(make_llama())  # made without a draft model: attach makes this one its own
    assert llm.draft_model is draft
    ids = chat_ids(llm, "Count from 1 to 30, separated by commas.")
    logged = lambda: [e for e in log_entries(serve.redis_url(), NAMESPACE) if e[: len(ids)] == ids]  # noqa: E731
    before = len(logged())  # other tests of this module's service asked it too
    out = greedy(llm, ids, 64)
    first = (draft.stats.steps, draft.stats.accepted)
    assert greedy(llm, ids, 64) == out
    second = (draft.stats.steps - first[0], draft.stats.accepted - first[1])
    assert second[1] > first[1] + 16, (first, second)  # the near copy remembered its first answer
    stats = draft.client.stats
    assert stats.near == draft.stats.calls and stats.remote == stats.fallback == stats.draft_calls == 0
    wait_for(lambda: len(logged()) == before + 2, 10, "both generations in the lifetime log")
    assert all(e[len(ids) : len(ids) + len(out)] == out for e in logged()[before:])
    draft.close()


def test_drafting_near_needs_the_vocabulary_and_an_engine_of_its_own(serve: Serve, make_llama, vocab_size: int) -> None:  # type: ignore[no-untyped-def]
    """The default, drafting near, is refused at once without the model's vocabulary size (not
    at the engine's first step); a ``Llama`` that has another draft model is not attached."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    with pytest.raises(ValueError, match=r"vocabulary size .*near=False"):
        DraftcacheDraftModel.connect(_target(serve), NAMESPACE, num_pred_tokens=K)
    draft = DraftcacheDraftModel.connect(
        _target(serve), NAMESPACE, num_pred_tokens=K, vocab_size=vocab_size, near_start_s=0
    )
    other = make_llama(LlamaPromptLookupDecoding(num_pred_tokens=K))
    with pytest.raises(ValueError, match="another draft model"):
        draft.attach(other)
    assert isinstance(other.draft_model, LlamaPromptLookupDecoding)
    draft.close()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_its_counts_are_served_for_prometheus_and_a_taken_port_stops_nothing(  # type: ignore[no-untyped-def]
    serve: Serve, make_llama, vocab_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    """``metrics_port``: the client's counts (where the drafts came from, commits) and the
    engine's (steps, tokens proposed and accepted: llama.cpp keeps none) on /metrics, read as the
    engine runs; the port freed by ``close``. A port already taken is logged and the engine
    drafts all the same."""
    port = free_port()
    draft = DraftcacheDraftModel.connect(
        _target(serve), NAMESPACE, num_pred_tokens=K, vocab_size=vocab_size, near_start_s=0, metrics_port=port
    )
    llm = draft.attach(make_llama())
    ids = chat_ids(llm, "Count from 1 to 30, separated by commas.")
    greedy(llm, ids, 48)
    greedy(llm, ids, 48)  # asked again: drafted from the first answer
    labels = (("engine", "llama.cpp"), ("namespace", NAMESPACE))
    got = _scrape(port)
    assert got[("draftcache_client_drafts_total", (*labels, ("source", "near")))] == draft.client.stats.near > 0
    assert got[("draftcache_client_drafts_total", (*labels, ("source", "fallback")))] == 0
    assert got[("draftcache_engine_accepted_tokens_total", labels)] == draft.stats.accepted > 16
    assert got[("draftcache_engine_proposed_tokens_total", labels)] == draft.stats.proposed
    assert got[("draftcache_engine_steps_total", labels)] == draft.stats.steps
    # A second engine told the same port: logged, and it drafts.
    with caplog.at_level(logging.ERROR, logger="decoder_client.client.metrics"):
        other = DraftcacheDraftModel.connect(
            _target(serve), NAMESPACE, num_pred_tokens=K, vocab_size=vocab_size, near_start_s=0, metrics_port=port
        )
    assert [r for r in caplog.records if f":{port}" in r.getMessage()], caplog.text
    other_llm = other.attach(make_llama())
    greedy(other_llm, ids, 16)
    assert other.stats.calls > 0
    other.close()
    draft.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)

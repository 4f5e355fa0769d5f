"""The vLLM proposer driven the way vLLM drives it, without vLLM: a batch of token rows that
grow by what verification accepts, rows vLLM would condense when requests finish, one
``propose`` call per step, against a real in-process service. (The tests in ``vllm/`` run the
real engine; these run wherever the project does.)"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from draftcache.v1 import draftcache_pb2 as pb
from transformers import LlamaConfig, LlamaForCausalLM

from cache_service.config import ServiceConfig
from cache_service.host.embedded_redis import free_port
from decoder_client.client import ClientSession
from decoder_client.engines.outcomes import EDGES, PRIOR
from decoder_client.engines.vllm import NAMESPACE_THREAD, DraftcacheProposer
from indexer.prior import PriorConfig, StaticPrior
from tests.client.conftest import greedy_continuation
from tests.service.conftest import Running, eventually, start_service, stop_service

K = 4
WIDTH = 256  # max_model_len
NS = "toy"


@dataclass
class Request:
    prompt: list[int]
    target: list[int]  # what greedy decoding produces after the prompt
    out: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.out) >= len(self.target)


class Engine:
    """vLLM's side of the contract: rows of prompt + output, ``num_tokens_no_spec`` per row,
    drafts verified against each request's greedy target (the longest agreeing prefix plus one
    token), finished requests removed and the batch condensed (the last row moved into the
    hole) before the next step, as vLLM's input batch does."""

    def __init__(self, proposer: DraftcacheProposer, rows: int = 8, token_s: float = 0.0, step_s: float = 0.0) -> None:
        self.proposer = proposer
        self.token_s = token_s  # each step sleeps this long per drafted token it verifies
        self.step_s = step_s  # ... and this long whatever it verifies (a target's forward)
        self.tokens = np.zeros((rows, WIDTH), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int32)
        self.reqs: list[Request | None] = [None] * rows
        self.drafts: list[list[int]] = [[] for _ in range(rows)]
        self.steps = 0
        self.longest_draft = 0
        self.verified = 0  # draft tokens verified (those of a request that just finished are dropped)

    def add(self, req: Request) -> None:
        i = self.reqs.index(None)
        self.reqs[i], self.drafts[i] = req, []
        self.tokens[i, : len(req.prompt)] = req.prompt
        self.lengths[i] = len(req.prompt)

    def step(self) -> None:
        if self.token_s or self.step_s:
            time.sleep(self.step_s + self.token_s * sum(len(d) for d in self.drafts))
        sampled: list[list[int]] = []
        self.verified += sum(len(d) for d, req in zip(self.drafts, self.reqs, strict=True) if req is not None)
        for i, req in enumerate(self.reqs):
            if req is None:
                sampled.append([])
                continue
            want = req.target[len(req.out) :]
            accepted = 0
            while (
                accepted < len(self.drafts[i])
                and accepted < len(want) - 1
                and self.drafts[i][accepted] == want[accepted]
            ):
                accepted += 1
            new = want[: accepted + 1]
            req.out += new
            self.tokens[i, self.lengths[i] : self.lengths[i] + len(new)] = new
            self.lengths[i] += len(new)
            sampled.append(new)
        drafts = self.proposer.propose(sampled, self.lengths, self.tokens)
        assert len(drafts) == len(self.reqs)
        for i, d in enumerate(drafts):
            assert len(d) <= K, f"{len(d)} draft tokens for row {i}"
            assert d == [] or sampled[i], "a draft for a row that produced nothing"
            self.longest_draft = max(self.longest_draft, len(d))
        self.drafts = [list(d) for d in drafts]
        self.steps += 1
        self._condense()

    def _condense(self) -> None:
        for i, req in enumerate(self.reqs):
            if req is not None and req.done:  # its drafts are dropped unverified
                self.reqs[i], self.lengths[i], self.drafts[i] = None, 0, []
        while None in self.reqs:
            hole = self.reqs.index(None)
            last = max((j for j, r in enumerate(self.reqs) if r is not None), default=-1)
            if last < hole:
                return
            n = self.lengths[last]
            self.tokens[hole, :n] = self.tokens[last, :n]
            self.lengths[hole], self.reqs[hole], self.drafts[hole] = n, self.reqs[last], self.drafts[last]
            self.reqs[last], self.lengths[last], self.drafts[last] = None, 0, []

    def run(self, requests: list[Request]) -> None:
        for r in requests:
            self.add(r)
        while any(r is not None for r in self.reqs):
            self.step()


def vllm_config(target: str, **settings: Any) -> Any:
    """The parts of vLLM's VllmConfig the proposer reads. Chains are cut where the service cut
    them (``token_cost`` 0): this engine's steps cost what the proposer's calls cost, which
    says nothing of what verifying a token would (one test measures it on steps that do).
    Drafting through the service (``near`` False), whose calls, sessions and faults most tests
    here are about; the near copy's tests ask for it."""
    section = {
        "target": target,
        "namespace": NS,
        "near": False,
        "deadline_s": 0.05,
        "idle_close_s": 0.5,
        "token_cost": 0.0,
        **settings,
    }
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=WIDTH, get_vocab_size=lambda: 128),
        additional_config={"draftcache": section},
    )


def workload() -> list[Request]:
    """Requests of different lengths (they finish at different steps), two identical ones."""
    text = [5, 17, 23, 42, 8, 15, 16, 4, 99, 7, 31, 64, 2, 11, 13, 21]
    reqs = [
        Request([1, 2, *text], [*text, 3, *text, 9, *text]),
        Request([3, 4, 5, 6], [7, 8, 9, 10, 11, 12]),
        Request([9, 9, *text[:8]], [*text[8:], *text, *text]),
        Request([9, 9, *text[:8]], [*text[8:], *text, *text]),
        Request([50, 51, 52], list(range(60, 100))),
    ]
    return reqs


@pytest.fixture
def running() -> Iterator[Running]:
    r = start_service(ServiceConfig(), port=free_port())
    yield r
    stop_service(r)


def proposer_for(running: Running, config: Any = None) -> DraftcacheProposer:
    """A proposer on ``running`` (with ``config``, else the default one), once the namespace it
    creates at start (in the background) is there: steps without a model take microseconds, a
    whole workload would be over first."""
    proposer = DraftcacheProposer(vllm_config(running.target) if config is None else config)
    eventually(lambda: any(n.name == NS for n in running.admin.Stats(pb.StatsRequest(), timeout=5).namespaces), 30)
    return proposer


def namespace_info(running: Running) -> pb.NamespaceInfo:
    (info,) = [n for n in running.admin.Stats(pb.StatsRequest(namespace=NS), timeout=5).namespaces if n.name == NS]
    return info


def test_sessions_follow_requests_and_every_request_is_committed_once(running: Running) -> None:
    proposer = proposer_for(running)  # which creates the namespace
    try:
        reqs = workload()
        Engine(proposer).run(reqs)
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert stats["sessions_opened"] == len(reqs)  # one session per request
        assert stats["rows_moved"] > 0  # the batch did condense
        assert stats["remote_drafts"] > 0 and stats["errors"] == 0
        # The part of the proposer's time spent waiting on the service's replies: some, and
        # never more than the proposer's time itself.
        assert stats["draft_calls"] > 0
        assert 0 < stats["draft_wait_ms_total"] <= stats["proposer_ms_mean"] * stats["steps"]
        # The engine goes idle: the sessions of the last step's requests are closed too.
        eventually(lambda: proposer.stats()["sessions_closed"] == len(reqs), 10)
        eventually(lambda: namespace_info(running).requests == len(reqs), 10)
        total = sum(len(r.prompt) + len(r.target) for r in reqs)
        assert total <= namespace_info(running).buffered_tokens <= total + len(reqs)  # separators
    finally:
        proposer.shutdown()


def test_a_repeated_workload_drafts_from_what_the_fleet_committed(running: Running) -> None:
    proposer = proposer_for(running)
    try:
        first = Engine(proposer)
        first.run(workload())
        eventually(lambda: namespace_info(running).requests == len(workload()), 10)
        again = Engine(proposer)
        again.run(workload())
        assert again.steps < first.steps  # longer accepted chains: the service remembered the answers
        assert again.longest_draft == K
    finally:
        proposer.shutdown()


@pytest.mark.parametrize("continue_chains", [True, False])
def test_steps_a_chain_foresaw_go_on_without_waiting(running: Running, continue_chains: bool) -> None:
    proposer = DraftcacheProposer(vllm_config(running.target, continue_chains=continue_chains))
    eventually(lambda: any(n.name == NS for n in running.admin.Stats(pb.StatsRequest(), timeout=5).namespaces), 30)
    try:
        Engine(proposer).run(workload())
        eventually(lambda: namespace_info(running).requests == len(workload()), 10)
        reqs = workload()  # asked again: the service's chains run past the K tokens the engine takes
        again = Engine(proposer)
        again.run(reqs)
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert again.longest_draft == K and stats["errors"] == 0
        if continue_chains:  # steps that took all K and made the chain's next token: the rest at once
            assert stats["chains_continued"] > 0, stats
        else:
            assert stats["chains_continued"] == 0
    finally:
        proposer.shutdown()


def test_chains_stop_short_of_max_model_len(running: Running) -> None:
    proposer = proposer_for(running)
    try:
        tokens = np.zeros((1, WIDTH), dtype=np.int32)
        tokens[0] = np.tile([1, 2, 3, 4], WIDTH // 4)  # every draft source would go on
        lengths = np.array([WIDTH - 3], dtype=np.int32)
        for _ in range(3):
            (draft,) = proposer.propose([[4]], lengths, tokens)
            assert len(draft) <= 2  # room for the draft and the bonus token, no more
        assert proposer.propose([[4]], np.array([WIDTH], dtype=np.int32), tokens) == [[]]  # full
    finally:
        proposer.shutdown()


def test_service_gone_local_drafts_within_the_deadline() -> None:
    proposer = DraftcacheProposer(vllm_config(f"127.0.0.1:{free_port()}"))  # nothing listens
    try:
        reqs = workload()
        engine = Engine(proposer)
        started = time.monotonic()
        engine.run(reqs)
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert stats["remote_drafts"] == 0 and stats["fallback_drafts"] > 0 and stats["errors"] == 0
        assert engine.longest_draft > 0  # prompt lookup found the copies
        assert stats["proposer_ms_max"] < 500, stats  # no step waited on the missing service
        assert time.monotonic() - started < 30
    finally:
        proposer.shutdown()


def test_a_rank_whose_drafts_vllm_does_not_read_stands_by(running: Running) -> None:
    """The second of two tensor-parallel ranks: no client, no session, nothing committed; its
    calls answered with no drafts (vLLM reads the first rank's)."""
    config = vllm_config(running.target)
    config.parallel_config = SimpleNamespace(rank=1, tensor_parallel_size=2, prefill_context_parallel_size=1)
    threads = threading.active_count()
    proposer = DraftcacheProposer(config)
    try:
        assert proposer.standby and threading.active_count() == threads  # no client, no idle watcher
        reqs = workload()
        engine = Engine(proposer)
        engine.run(reqs)
        assert [r.out for r in reqs] == [r.target for r in reqs] and engine.longest_draft == 0
        assert proposer.stats() == {"standby": True, "num_speculative_tokens": K}
    finally:
        proposer.shutdown()
    assert not any(n.name == NS for n in running.admin.Stats(pb.StatsRequest(), timeout=5).namespaces)  # never asked


def test_the_deadline_follows_the_engine_step(running: Running) -> None:
    proposer = DraftcacheProposer(vllm_config(running.target, deadline_s=0.005, deadline_step_fraction=0.1))
    try:
        assert proposer.stats()["deadline_ms"] == 5.0  # no step seen: the floor
        tokens = np.zeros((1, WIDTH), dtype=np.int32)
        tokens[0, :4] = [1, 2, 3, 4]
        for n in range(5, 9):  # an engine step of ~150 ms (a small CPU engine's)
            proposer.propose([[n]], np.array([n], dtype=np.int32), tokens)
            tokens[0, n - 1] = n
            time.sleep(0.15)
        assert 13.0 <= proposer.stats()["deadline_ms"] <= 50.0  # a tenth of the step, within the cap
    finally:
        proposer.shutdown()


def test_a_new_requests_first_draft_comes_from_the_service(running: Running) -> None:
    proposer = DraftcacheProposer(vllm_config(running.target, deadline_s=0.2))
    eventually(lambda: any(n.name == NS for n in running.admin.Stats(pb.StatsRequest(), timeout=5).namespaces), 30)
    try:
        tokens = np.zeros((1, WIDTH), dtype=np.int32)
        tokens[0, :9] = [5, 6, 7, 8, 9, 5, 6, 7, 8]
        proposer.propose([[8]], np.array([9], dtype=np.int32), tokens)  # the request's first step
        stats = proposer.stats()
        # Its open landed within half the step's deadline: the service drafted, not the fallback.
        assert stats["sessions_opened"] == 1 and stats["remote_drafts"] == 1 and stats["fallback_drafts"] == 0
    finally:
        proposer.shutdown()


def test_service_stopped_mid_generation() -> None:
    port = free_port()
    running = start_service(ServiceConfig(), port=port)
    proposer = proposer_for(running)
    back = None
    try:
        reqs = workload()
        engine = Engine(proposer)
        for r in reqs:
            engine.add(r)
        while proposer.stats()["remote_drafts"] == 0:  # the sessions' opens land (in the background)
            assert engine.steps < 50, proposer.stats()
            engine.step()
            time.sleep(0.01)
        remote = proposer.stats()["remote_drafts"]
        stop_service(running)
        while any(r is not None for r in engine.reqs):
            engine.step()
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert remote > 0 and stats["fallback_drafts"] > 0 and stats["errors"] == 0
        # The requests ended while the service was down: the service comes back (empty, on the
        # same address); the engine stays idle, and every request is committed all the same.
        back = start_service(ServiceConfig(), port=port)
        back.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NS, vocab_size=128), timeout=10)
        eventually(lambda: namespace_info(back).requests == len(reqs), 20)
        proposer.shutdown()
        assert proposer.stats()["commits_retried"] == len(reqs) and proposer.stats()["commits_dropped"] == 0
    finally:
        proposer.shutdown()
        if back is not None:
            stop_service(back)


def test_chains_end_where_a_token_costs_more_than_it_is_likely_to_save(running: Running) -> None:
    first = proposer_for(running)
    try:
        Engine(first).run(workload())
    finally:
        first.shutdown()
    eventually(lambda: namespace_info(running).requests == len(workload()), 10)
    proposer = DraftcacheProposer(vllm_config(running.target, token_cost=-1.0))  # measured
    try:
        assert proposer.stats()["chain_cut_prob"] == 0.3  # the prior, until measured
        # The workload again (a few times: a step of the line needs no request starting in it),
        # on an engine where each verified token costs 10 ms, several times what the rest of a
        # step costs here: only tokens nearly sure to be accepted pay.
        for _ in range(6):
            Engine(proposer, token_s=0.01).run(workload())
        stats = proposer.stats()
        # What the engine charges, 10 ms a token it verifies: the drafts of a request that ended
        # at a step are dropped unverified, and not counted as the next step's.
        assert stats["cost_measured"] and stats["step_per_token_ms"] == pytest.approx(10, rel=0.2), stats
        assert stats["chain_cut_prob"] >= 0.5, stats
        # Beside the line, the step times it was fitted to: longer the more tokens were proposed.
        curve = [ms for ms, _ in stats["step_ms_by_proposed"].values()]
        assert len(curve) >= 2 and curve[-1] > curve[0] + 5, stats["step_ms_by_proposed"]
        # Requests opened once it was measured asked the service for chains that run on to
        # chain_run_on of that cut (the rest kept for steps the chain foresaw).
        Engine(proposer, token_s=0.01).run(workload()[:1])
        request = proposer._client._core.open_request([ClientSession(np.array([1, 2], np.int32), 2)], now=True)
        assert request is not None
        assert request.sessions[0].params.chain_min_prob >= 0.5 * proposer.settings.chain_run_on > 0
    finally:
        proposer.shutdown()


def test_chains_are_cut_on_the_chances_this_engine_bore_out(running: Running) -> None:
    proposer = proposer_for(running)
    proposer.settings = dataclasses.replace(proposer.settings, token_cost=0.3, recalibrate=True)
    proposer._cost = proposer.settings.step_cost()  # a fixed cut at 0.3, whatever the steps cost
    cut: list[tuple[np.ndarray, np.ndarray]] = []
    choose = proposer._chain_to_propose

    def chosen(tree: Any, room: int, min_prob: float, chances: Any = None) -> Any:
        tokens, claims, likely = choose(tree, room, min_prob, chances)
        assert chances is not None
        cut.append((claims, likely))
        return tokens, claims, likely

    proposer._chain_to_propose = chosen
    learnt: list[np.ndarray] = []
    record_many = proposer._outcomes.record_many

    def recorded(chains: Sequence[np.ndarray], accepted: Sequence[int]) -> None:
        learnt.extend(chains)
        record_many(chains, accepted)

    proposer._outcomes.record_many = recorded  # type: ignore[method-assign]
    try:
        for _ in range(2):  # the second time, the service knows the requests and its chains run long
            Engine(proposer).run(workload())
        stats = proposer.stats()
    finally:
        proposer.shutdown()
    assert stats["chains"]["proposed_tokens"] > 0
    # Every token proposed was likely enough once corrected; the correction is what the
    # outcomes say (accepted over expected per score bin, 8 pseudo-tokens at the claim) ...
    assert all((likely >= 0.3).all() for _, likely in cut)
    for name, counts in stats["chains"]["by_score"].items():
        i = [f"{a:.2f}-{b:.2f}" for a, b in itertools.pairwise(EDGES)].index(name)
        want = (counts["accepted"] + PRIOR) / (counts["expected"] + PRIOR)
        assert stats["recalibration"][i] == pytest.approx(want, abs=2e-3)
    # ... and it learns from the claims themselves, never from what it made of them.
    assert learnt and all(any(np.shares_memory(scores, c) for c, _ in cut) for scores in learnt)
    assert any(not np.allclose(c, likely) for c, likely in cut if c.size)


def near_prior(tmp_path: Path) -> Path:
    """A prior file ('warm --out') made from the workload's answers (each twice: a prior keeps
    what a corpus repeats)."""
    corpus = np.concatenate([np.array([*r.prompt, *r.target, 0], dtype=np.int32) for r in workload() * 2])
    path = tmp_path / "prior.npz"
    path.write_bytes(StaticPrior.build(corpus, PriorConfig(orders=(1, 2, 3))).to_bytes())
    return path


def test_a_near_copy_drafts_in_the_engine_and_commits_to_the_service(running: Running) -> None:
    """Drafting near, the default (no ``near`` setting given)."""
    config = vllm_config(running.target)
    del config.additional_config["draftcache"]["near"]
    proposer = proposer_for(running, config)
    try:
        assert proposer.settings.near
        first = Engine(proposer)
        reqs = workload()
        first.run(reqs)
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert stats["near_drafts"] > 0 and stats["errors"] == 0
        assert stats["remote_drafts"] == stats["fallback_drafts"] == stats["draft_calls"] == 0  # no call on a step
        # Each finished request reached the service's lifetime memory, once (its namespace was
        # created at start): the fleet learns from an engine drafting near.
        eventually(lambda: proposer.stats()["sessions_closed"] == len(reqs), 10)
        eventually(lambda: namespace_info(running).requests == len(reqs), 20)
        total = sum(len(r.prompt) + len(r.target) for r in reqs)
        assert total <= namespace_info(running).buffered_tokens <= total + len(reqs)
        eventually(lambda: proposer.stats()["commits_pending"] == 0, 10)
        assert proposer.stats()["commits_retried"] == 0  # every first commit landed
        # ... and the near copy drafts the same requests asked again from what it finished.
        again = Engine(proposer)
        again.run(workload())
        assert again.steps < first.steps and again.longest_draft == K
    finally:
        proposer.shutdown()


def test_a_near_copy_drafts_from_its_prior_file_with_the_service_gone(tmp_path: Path) -> None:
    port = free_port()  # nothing listens
    plain = DraftcacheProposer(vllm_config(f"127.0.0.1:{port}", near=True))
    warmed = DraftcacheProposer(vllm_config(f"127.0.0.1:{port}", near=True, prior_file=str(near_prior(tmp_path))))
    try:
        engines = [Engine(plain), Engine(warmed)]
        for engine in engines:
            reqs = workload()
            engine.run(reqs)
            assert [r.out for r in reqs] == [r.target for r in reqs]
        assert engines[1].steps < engines[0].steps  # the prior knew the answers
        for proposer in (plain, warmed):
            stats = proposer.stats()
            assert stats["errors"] == 0 and stats["fallback_drafts"] == 0
            assert stats["proposer_ms_max"] < 500, stats  # no step waited on the missing service
        warmed.shutdown()  # one try at the commits, which the service never took: not lost silently
        assert warmed.stats()["commits_pending"] == len(workload()) and warmed.stats()["commits_dropped"] == 0
    finally:
        plain.shutdown()
        warmed.shutdown()


def test_near_settings_are_checked_at_the_engines_start(tmp_path: Path) -> None:
    before = set(_namespace_threads())
    with pytest.raises(FileNotFoundError):
        DraftcacheProposer(vllm_config("127.0.0.1:1", near=True, prior_file=str(tmp_path / "missing.npz")))
    assert set(_namespace_threads()) == before  # a start that fails leaves nothing waiting for the service
    (tmp_path / "bad.npz").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a prior file"):
        DraftcacheProposer(vllm_config("127.0.0.1:1", near=True, prior_file=str(tmp_path / "bad.npz")))
    with pytest.raises(ValueError, match="near copy only, and near is false"):
        DraftcacheProposer(vllm_config("127.0.0.1:1", prior_file=str(tmp_path / "bad.npz")))


def _draft_model(folder: Path, seed: int = 0, vocab: int = 128) -> LlamaForCausalLM:
    """A tiny Llama saved to ``folder``, sure of its next tokens (its output weights scaled
    up): the draft model, and, decoding greedily, the target whose outputs it drafts."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=WIDTH,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(folder)
    return model


def _model_workload(model: LlamaForCausalLM) -> list[Request]:
    """The workload's prompts, each answered by the model's own greedy decoding."""
    return [Request(r.prompt, greedy_continuation(model, r.prompt, 24)) for r in workload()]


def test_a_draft_model_drafts_beside_the_cache(running: Running, tmp_path: Path) -> None:
    # The draft model is the target itself here, so every chain of its that goes is accepted
    # whole: what this checks is the mechanics (each request's model follows its row, chains are
    # counted apart and never recalibrate the cache's, requests are still committed).
    model = _draft_model(tmp_path / "draft")
    proposer = proposer_for(running, vllm_config(running.target, draft_model=str(tmp_path / "draft")))
    try:
        reqs = _model_workload(model)
        engine = Engine(proposer)
        engine.run(reqs)
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert stats["errors"] == 0, stats
        assert stats["model_steps"] > 0 and stats["model_proposed"] > stats["model_steps"], stats
        # Every chain of the model's is the target's own text; only a request's last one may run
        # past its end (the engine keeps at least its own token).
        assert stats["model_proposed"] - stats["model_accepted"] <= (K - 1) * len(reqs), stats
        assert engine.steps < sum(len(r.target) for r in reqs) / 2  # most steps took a whole chain
        # One forward a step for each request, K - 1 more where its chain went (a request's last
        # chain is dropped unverified, uncounted); each request's model keeps its KV cache, so it
        # reads each token about once (a rejected or run-past token, and the last one again).
        chains_made = stats["model_steps"] + len(reqs)
        assert stats["model_forwards"] <= engine.steps * len(reqs) + (K - 1) * chains_made, stats
        text = sum(len(r.prompt) + len(r.target) for r in reqs)
        assert text <= stats["model_tokens_read"] <= text + engine.steps * len(reqs) + K * chains_made, stats
        # The rows read together: a read a step for the batch's new tokens, one per depth of its chains.
        assert stats["model_reads"] <= engine.steps * K, stats
        assert stats["model_reads"] < stats["model_forwards"] / 2, stats  # five requests shared them
        # The cache's outcomes learnt from the cache's chains only.
        assert stats["chains"]["proposed_tokens"] == engine.verified - stats["model_proposed"], stats
        eventually(lambda: namespace_info(running).requests == len(reqs), 10)
        eventually(lambda: proposer.stats()["model_rows_live"] == 0, 10)  # idle: every request ended
        # ... and each counted the steps it drafted: what a prompt's read is charged over.
        assert 1 < proposer.stats()["model_request_steps"] <= engine.steps
    finally:
        proposer.shutdown()


def _fresh_workload(model: LlamaForCausalLM, seed: int) -> list[Request]:
    """Five requests of random prompts, each answered by the model's greedy decoding: text the
    service has not seen, so that the cache does not know the answers."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(1, 128, 6)] for _ in range(5)]
    return [Request(p, greedy_continuation(model, p, 24)) for p in prompts]


@pytest.mark.parametrize("target", ["dear", "free"])
def test_a_draft_models_chains_go_where_they_pay_for_their_reads(running: Running, tmp_path: Path, target: str) -> None:
    # The same draft model (the target itself: its chains are right) beside an engine whose
    # steps cost 60 ms (a target's forward: the model's reads, a millisecond or two, are cheap
    # beside it) and beside one whose steps cost little but what each verified token does
    # (2 ms), where a read of the model costs more than a token it could bring is worth. Once
    # the step's cost is measured, the model's chains go in the first; in the second the model
    # stops reading the rows at all: a chain right throughout could not pay for its reads.
    model = _draft_model(tmp_path / "draft")
    config = vllm_config(running.target, draft_model=str(tmp_path / "draft"), token_cost=-1.0)  # measured
    proposer = proposer_for(running, config)
    step_s = 0.06 if target == "dear" else 0.0
    try:
        seed = 0
        while not proposer.stats()["cost_measured"] and seed < 12:
            Engine(proposer, step_s=step_s, token_s=0.002).run(_fresh_workload(model, seed))
            seed += 1
        before = proposer.stats()
        assert before["cost_measured"], before
        reqs = _fresh_workload(model, seed)
        engine = Engine(proposer, step_s=step_s, token_s=0.002)
        engine.run(reqs)
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert stats["errors"] == 0, stats
        steps, skipped, forwards = (stats[k] - before[k] for k in ("model_steps", "model_skipped", "model_forwards"))
        if target == "dear":
            assert steps > 0 and skipped <= steps // 4, stats
            assert engine.steps < sum(len(r.target) for r in reqs) / 2  # most steps took a whole chain
        else:
            assert steps == 0 and skipped > 0 and forwards <= skipped // 4, stats
        # The line measures the engine's steps: the model's reads, which the rule prices
        # itself, are the proposer's time and not in them.
        assert stats["step_per_token_ms"] == pytest.approx(2, rel=0.25), stats
    finally:
        proposer.shutdown()


@pytest.mark.parametrize("target", ["dear", "free"])
def test_a_prompt_is_read_once_its_read_is_priced(running: Running, tmp_path: Path, target: str) -> None:
    # Five requests of 200-token prompts start together in a fresh engine. A prompt is a read of
    # its own, dearer than a step's catch-up: none is read until the engine's first steps say
    # what a token is worth. Then one read times what a prompt's token takes, and the others are
    # read where a chain right throughout pays for that read too: beside a target whose steps
    # cost 60 ms, they are (those the cache does not draft better); beside one whose steps cost
    # little, none is but the one that timed the rate.
    model = _draft_model(tmp_path / "draft")
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(1, 128, 200)] for _ in range(5)]
    reqs = [Request(p, greedy_continuation(model, p, 24)) for p in prompts]
    config = vllm_config(running.target, draft_model=str(tmp_path / "draft"), token_cost=-1.0)  # measured
    proposer = proposer_for(running, config)
    try:
        engine = Engine(proposer, step_s=0.06 if target == "dear" else 0.0, token_s=0.002)
        for r in reqs:
            engine.add(r)
        for _ in range(8):  # a token's worth is not known before 8 steps are timed
            engine.step()
        early = proposer.stats()
        assert early["model_forwards"] == 0 and early["model_waited"] == 8 * len(reqs), early
        while any(r is not None for r in engine.reqs):
            engine.step()
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert stats["errors"] == 0, stats
        prompt = len(prompts[0]) + 8  # a prompt and the tokens its first 8 steps produced
        if target == "dear":
            assert stats["model_tokens_read"] > 2 * prompt and stats["model_steps"] > len(reqs), stats
        else:
            assert prompt <= stats["model_tokens_read"] < 2 * prompt, stats
    finally:
        proposer.shutdown()


def test_a_draft_model_drafts_with_the_service_gone_for_as_many_requests_as_allowed(tmp_path: Path) -> None:
    model = _draft_model(tmp_path / "draft")
    config = vllm_config(f"127.0.0.1:{free_port()}", draft_model=str(tmp_path / "draft"), draft_model_rows=2)
    proposer = DraftcacheProposer(config)  # nothing listens
    try:
        reqs = _model_workload(model)
        engine = Engine(proposer)
        for r in reqs:
            engine.add(r)
        held = 0
        while any(r is not None for r in engine.reqs):
            engine.step()
            held = max(held, proposer.stats()["model_rows_live"])
        assert [r.out for r in reqs] == [r.target for r in reqs]
        stats = proposer.stats()
        assert held == 2, stats  # five requests, two models
        assert stats["remote_drafts"] == 0 and stats["errors"] == 0, stats
        assert 0 < stats["model_proposed"] - stats["model_accepted"] <= (K - 1) * len(reqs) or (
            stats["model_proposed"] == stats["model_accepted"] > 0
        ), stats
    finally:
        proposer.shutdown()


def test_a_draft_model_that_cannot_read_the_targets_ids_is_refused(tmp_path: Path) -> None:
    _draft_model(tmp_path / "small", vocab=64)
    with pytest.raises(ValueError, match="reads 64 ids; the target's vocabulary has 128"):
        DraftcacheProposer(vllm_config(f"127.0.0.1:{free_port()}", draft_model=str(tmp_path / "small")))
    with pytest.raises(ValueError, match="no Hugging Face model folder"):
        DraftcacheProposer(vllm_config(f"127.0.0.1:{free_port()}", draft_model=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="draft_model_rows must be >= 1"):
        DraftcacheProposer(
            vllm_config(f"127.0.0.1:{free_port()}", draft_model=str(tmp_path / "small"), draft_model_rows=0)
        )


def _namespace_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == NAMESPACE_THREAD]


def test_a_shutdown_ends_the_namespace_creation_waiting_for_the_service(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens: the proposer's namespace creation waits for the service in the
    background, and ends with the proposer's shutdown, without a warning, not a minute later."""
    before = set(_namespace_threads())
    with caplog.at_level(logging.INFO, logger="decoder_client.engines.vllm"):
        proposer = DraftcacheProposer(vllm_config(f"127.0.0.1:{free_port()}"))
        (waiting,) = set(_namespace_threads()) - before
        time.sleep(0.5)
        assert waiting.is_alive()  # still waiting for the service
        proposer.shutdown()
        waiting.join(5)
    assert not waiting.is_alive()
    assert "not created" not in caplog.text


def test_a_service_that_comes_up_late_gets_the_namespace_within_a_second_or_two() -> None:
    """The service comes up half a minute after the engine (a first start compiles its loops):
    the namespace is created within seconds of it. With gRPC's default reconnect backoff, which
    grows to two minutes, the next try would come about 15 s after it, or past the wait."""
    port = free_port()
    proposer = DraftcacheProposer(vllm_config(f"127.0.0.1:{port}"))
    try:
        time.sleep(30)
        running = start_service(ServiceConfig(), port=port)
        try:
            up = time.monotonic()
            stats = running.admin.Stats
            eventually(lambda: any(n.name == NS for n in stats(pb.StatsRequest(), timeout=5).namespaces), 20)
            assert time.monotonic() - up < 5
        finally:
            stop_service(running)
    finally:
        proposer.shutdown()

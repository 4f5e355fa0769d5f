"""draftcache as vLLM's speculative proposer (its ``custom_class`` method).

>>> from vllm import LLM  # doctest: +SKIP
>>> llm = LLM(model=folder, speculative_config={  # doctest: +SKIP
...     "method": "custom_class", "model": "decoder_client.engines.vllm.DraftcacheProposer",
...     "num_speculative_tokens": 4},
...     additional_config={"draftcache": {"target": "127.0.0.1:50051", "namespace": "smollm2"}})

vLLM builds the class in its worker process with the engine's configuration and calls
:meth:`DraftcacheProposer.propose` once per engine step, synchronously, after sampling: per batch
row, the tokens sampled this step (none for a prompt still being prefilled), the row's length
and the batch's token matrix. It wants at most ``num_speculative_tokens`` ids per row (more ends
the engine). Settings: :class:`~decoder_client.engines.settings.EngineSettings`, from
``additional_config["draftcache"]`` or ``DRAFTCACHE_*``.

Where drafts come from. By default (``near``) from a near copy of the namespace in the worker
(:mod:`decoder_client.client.near`): no call on a step's path, the service committed to and
followed in the background. With ``near`` false, from the service, one batched call a step.
Either answers the same calls below.

Request identity. vLLM gives a custom proposer no request ids and no "request finished" call:
rows move when the batch condenses, vanish when a request finishes or is preempted, and
identical prompts can run side by side. Rather than reach into the model runner (its
``input_batch``, through a ``vllm.general_plugins`` hook patching private methods that change
between releases), the proposer tells requests apart by what it is given:
:class:`~decoder_client.engines.rows.RowTracker` continues a request in the row whose tokens
start with its whole history, so each draft session's context is always exactly a prefix of its
row (drafts never come from another request's context, whatever the engine did to its batch),
and identical histories are interchangeable. Each tracked request is one draft session: opened
once with its row (in the background: the step never waits on the open), then each step sends
only its new tokens, and one batched draft call serves every row. (An open may take half a
draft deadline of the step that admits the request: landed by then, the request's first draft
comes from the service.) A request no row continues
(finished, preempted, or not scheduled) is closed with commit, so its tokens reach the
service's lifetime memory; one that comes back (a preempted request resumed) is a new session
opened with its whole row, and commits again what it had (the service skips a long leading
part its memory already holds: see the architecture notes' multi-turn commits).
The engine calls nothing once its last request ends, so a watcher thread closes every session,
with commit, once the engine has made no step for ``idle_close_s``; a request that was only in
a long step comes back as a new session, as a resumed one does.

One proposer drafts per engine. vLLM builds a custom proposer on every worker of its last
pipeline stage, tensor-parallel ranks included, and reads the drafts of one of them (see
:func:`drafts_read_here`); the others stand by: no client, no near copy, no sessions. Every
rank drafting would have drafted each step several times over and committed every request
once per rank, so that the fleet's memory counted it as several.

How much to propose. The service answers each row a chain with the calibrated chance of each
token being reached (with ``recalibrate``, corrected by how the proposer's own chains fared
in this engine: :meth:`~decoder_client.engines.outcomes.ChainOutcomes.chances`). The proposer
cuts the chain where a token is no longer worth verifying and drops a step's drafts that do
not pay for the step's own extra cost, both measured from the engine's step times
(:mod:`~decoder_client.engines.step_cost`): on a CPU a drafted token costs a good part of a
step, on a GPU at batch 1 almost nothing.

Beside a draft model. With ``draft_model`` (a Hugging Face folder whose tokenizer is the
target's), a request's chain is a small model's greedy one wherever more of it is expected to
be accepted than of the cache's, once the engine's steps are timed net of what each costs: the
engine's verification and the model's reads (:mod:`decoder_client.engines.beside`; the rule and
why in :mod:`decoder_client.chain_model`). The model runs in this worker on the target's device
and in its dtype, in the engine's thread, each request with its own KV cache. The batch reads
together: every step costs one forward over all rows' new tokens (a prompt is read alone), and
one more per depth of the chains that go, at most ``K - 1``; a row whose model's chain could not
pay even if right throughout is not read that step (``model_skipped``), nor a prompt before its
read can be priced (``model_waited``). The models' reads are the
proposer's time: the step the cost line records is the interval less them. At most ``draft_model_rows``
requests hold a model at once; the rest draft from the cache alone. The model's chains are
counted apart (``model_*`` in the stats) and stay out of the outcomes that correct the cache's
claims. With the service down, they still go.

The service slow or down costs a step at most the draft call's deadline (a fraction of the
engine's recent step time, within set bounds: :mod:`~decoder_client.engines.deadline`): past it
the client drafts locally (prompt lookup over the row's own tokens), and an error inside the proposer
leaves that step without drafts instead of stopping the engine.

Importing this module does not import the client (nor numba, under it): vLLM's CPU start-up
fails in a process that has (``'_lib_fn_wrapper' object has no attribute 'get'``, from its scan
of every loaded module), and a script building an ``LLM`` is such a process, or its spawned
children re-import the script. vLLM's worker imports the client when it builds the proposer.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.engines.outcomes import ChainOutcomes
from decoder_client.engines.rows import RowTracker, Track
from decoder_client.engines.settings import EngineSettings
from decoder_client.engines.step_stats import StepStats
from indexer.fingerprint import FINGERPRINT_IDS, fingerprint

if TYPE_CHECKING:
    from decoder_client.client import ClientConfig, ClientSession
    from decoder_client.client.drafting import Drafting
    from decoder_client.engines.beside import ModelRows

logger = logging.getLogger(__name__)

CLASS_PATH = "decoder_client.engines.vllm.DraftcacheProposer"
SECTION = "draftcache"  # the key of our settings in vLLM's additional_config
NAMESPACE_THREAD = "draftcache-namespace"
NAMESPACE_POLL_S = 1.0  # how often the namespace's creation, waiting for the service, sees a shutdown


def speculative_config(num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` naming this proposer.

    >>> speculative_config(4)["model"]
    'decoder_client.engines.vllm.DraftcacheProposer'
    """
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": num_speculative_tokens}


class DraftcacheProposer:
    """vLLM's custom proposer backed by a draftcache service; see the module docstring."""

    def __init__(self, vllm_config: Any) -> None:
        # The client, in vLLM's worker (see the module docstring).
        from decoder_client.engines.beside import Proposal
        from decoder_client.engines.step_cost import chain_to_propose

        self._chain_to_propose = chain_to_propose
        self._proposal = Proposal
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.standby = not drafts_read_here(vllm_config)
        if self.standby:  # vLLM reads another worker's drafts: this one only answers its calls
            logger.info("draftcache proposer on standby: vLLM reads the drafts of another rank")
            return
        self.settings = EngineSettings.from_sources(_section(vllm_config.additional_config), os.environ)
        self.client_config = self.settings.client_config(self.num_speculative_tokens)
        self._clock = self.settings.step_clock()
        self._deadline = self.settings.step_deadline()
        self._cost = self.settings.step_cost()
        vocab = int(vllm_config.model_config.get_vocab_size())
        tokenizer = tokenizer_fingerprint(vllm_config.model_config)
        self.client_config = dataclasses.replace(self.client_config, vocab_size=vocab, tokenizer=tokenizer)
        self._client: Drafting = self.settings.draft_client(self.num_speculative_tokens, vocab, tokenizer)
        self._metrics = self.settings.client_metrics(self._client, "vllm")  # vLLM counts its drafts' outcomes itself
        self._models = draft_models(vllm_config, self.settings, vocab) if self.settings.draft_model else None
        self._model_steps = self._model_proposed = self._model_accepted = 0
        self._tracker = RowTracker()
        self._lock = threading.Lock()  # propose (the engine's thread) and the idle watcher
        self._stats = StepStats()
        self._outcomes = ChainOutcomes()  # how the chains sent fared
        # id(request) -> it, its chain's claims (None: the draft model's chain) and length
        self._sent: dict[int, tuple[Track, np.ndarray | None, int]] = {}
        self._opened = self._closed = self._moved = self._idle_closes = self._errors = self._unworthy = 0
        self._last_call = time.monotonic()
        self._stats_written = 0.0
        self._stopping = threading.Event()
        threading.Thread(target=self._close_when_idle, name="draftcache-idle", daemon=True).start()
        # In the background (the engine's start never waits on the service), once nothing above
        # can fail (a start that fails leaves no thread behind), until shutdown at the latest.
        if self.settings.create_namespace:
            create = functools.partial(ensure_namespace, self.client_config, vocab, stop=self._stopping)
            threading.Thread(target=create, name=NAMESPACE_THREAD, daemon=True).start()
        atexit.register(self.shutdown)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU runner calls it with the target model; a draft model (``draft_model``)
        was loaded with the proposer."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """At most ``num_speculative_tokens`` draft ids per batch row (none for a row still
        prefilling its prompt)."""
        if self.standby:
            return [[] for _ in sampled_token_ids]
        start = time.perf_counter()
        with self._lock:
            self._last_call = time.monotonic()
            interval = self._clock.tick(start)
            self._deadline.step(interval)
            try:
                drafts, live = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, interval)
            except Exception:  # a proposer must not stop the engine: this step goes without drafts
                self._errors += 1
                logger.exception("draftcache proposer failed; no drafts this step")
                drafts, live = [[] for _ in sampled_token_ids], 0
                self._sent = {}  # no chain went out: none to score at the next step
            self._stats.record(interval=interval, seconds=time.perf_counter() - start, rows=live)
            if time.monotonic() - self._stats_written >= self.settings.stats_every_s:
                self._write_stats()
        return drafts

    def _propose(
        self, sampled: Sequence[Sequence[int]], lengths: np.ndarray, token_rows: np.ndarray, interval: float | None
    ) -> tuple[list[list[int]], int]:
        produced = {i: len(s) for i, s in enumerate(sampled) if len(s) and int(lengths[i]) < self.max_model_len}
        live = list(produced)
        step = self._tracker.step(token_rows, lengths, produced)
        self._moved += step.moved
        self._close(step.left)
        tracks = [step.track(i) for i in live]
        verified = [  # what the engine made of the last chains: each one's claims, length and how many it kept
            (sent[1], sent[2], len(gained) - 1)
            for track, gained in step.continued.values()
            if (sent := self._sent.get(id(track))) is not None and sent[0] is track
        ]
        fared = [(claims, kept) for claims, _, kept in verified if claims is not None]  # the cache's chains
        if fared:
            self._outcomes.record_many(*zip(*fared, strict=True))
        for _, n, kept in (v for v in verified if v[0] is None):  # the draft model's
            self._model_steps += 1
            self._model_proposed += n
            self._model_accepted += min(n, kept)
        self._sent = {}
        fresh = [t for t in tracks if t.payload is None]  # new rows (and any an earlier error left unopened)
        # The models' reads in the last call are the proposer's time, not the engine's; taken every
        # call, so that a call after a pause leaves none of its own to a later step.
        reading = 0.0 if self._models is None else self._models.spent()
        if interval is not None:
            # The step just verified what the last call proposed to the requests still here (a
            # request that ended at the last step had its drafts dropped unverified), over the
            # rows that produced tokens now; one that evaluated a prompt (a row still
            # prefilling, or one that just started) is not a step of the cost line.
            prefill = bool(fresh) or any(not len(s) and int(lengths[i]) > 0 for i, s in enumerate(sampled))
            self._cost.record(
                interval - reading,  # the engine's part
                sum(n for _, n, _ in verified),
                rows=max(1, len(live)),
                produced=sum(produced.values()),
                counted=not prefill,
            )
        if fresh:  # their first draft comes from the service if their open lands in half a deadline
            self._client.cut_chains_at(self._cost.ask_prob)  # the service picks chains for this cut
            new = self._client.open([t.tokens for t in fresh], wait=False, wait_s=self._deadline.seconds / 2)
            for t, session in zip(fresh, new, strict=True):
                t.payload = session
            self._opened += len(fresh)
        opened = {id(t) for t in fresh}
        new_tokens: list[list[int]] = [
            [] if id(t) in opened else step.continued[i][1].tolist() for i, t in zip(live, tracks, strict=True)
        ]
        sessions = [_session(t) for t in tracks]
        trees = self._client.draft(sessions, new_tokens, deadline_s=self._deadline.seconds) if live else []
        drafts: list[list[int]] = [[] for _ in sampled]
        chances = self._outcomes.chances if self.settings.recalibrate else None
        chains = []  # each row's chain cut at the drafter's cut, then trimmed to what the step pays for
        rooms = []
        for i, track, tree in zip(live, tracks, trees, strict=True):
            room = min(self.num_speculative_tokens, self.max_model_len - int(lengths[i]) - 1)
            if room > 0:
                ours = self._chain_to_propose(tree, room, self._cost.ask_prob, chances)
                chains.append((i, track, self._proposal(*ours, model=False)))
                rooms.append(room)
        if self._models is not None and chains:  # the models read every row either way: they follow the requests
            rows = [c[1] for c in chains]
            proposals = self._models.beside(
                rows, [t.tokens for t in rows], [c[2] for c in chains], rooms, self._cost.ask_prob, self._cost
            )
            chains = [(i, track, p) for (i, track, _), p in zip(chains, proposals, strict=True)]
        # keep() weighs the step as a whole: where no drafts pay for the step's cost, none go.
        for (i, track, p), n in zip(chains, self._cost.keep([c[-1].scores for c in chains]), strict=True):
            drafts[i] = p.chain[:n].tolist()
            if n:  # the claims, not the corrected chances: the correction learns from them
                self._sent[id(track)] = (track, None if p.model else p.claims[:n], n)
        if not self._sent:
            self._unworthy += 1
        return drafts, len(live)

    def _close(self, tracks: Sequence[Track]) -> None:
        """End these requests' sessions, with commit (in the background), and free their draft
        models."""
        if self._models is not None:
            self._models.release(tracks)
        sessions = [_session(t) for t in tracks if t.payload is not None]
        if sessions:
            self._client.close(sessions, commit=True)
            self._closed += len(sessions)

    def _close_when_idle(self) -> None:
        idle = self.settings.idle_close_s
        while not self._stopping.wait(idle / 4):
            if time.monotonic() - self._last_call < idle or not self._lock.acquire(blocking=False):
                continue
            try:
                if time.monotonic() - self._last_call >= idle:
                    if self._tracker.tracks:
                        self._idle_closes += 1
                        self._close(self._tracker.clear())
                        self._write_stats()
                        logger.info("draftcache proposer idle: %s", self.stats())
                    self._client.settle()  # requests kept to commit go out while the engine rests
            except Exception:
                logger.exception("draftcache proposer: closing idle sessions failed")
            finally:
                self._lock.release()

    def stats(self) -> dict[str, Any]:
        """Step timings (the proposer's own time per step beside the engine's step time, in ms,
        and how much of it went waiting on draft calls), sessions opened and closed, and where
        the drafts came from (a proposer on standby: that alone)."""
        if self.standby:
            return {"standby": True, "num_speculative_tokens": self.num_speculative_tokens}
        client = self._client.stats
        return {
            **self._stats.summary(),
            "num_speculative_tokens": self.num_speculative_tokens,
            "sessions_opened": self._opened,
            "sessions_closed": self._closed,
            "sessions_live": len(self._tracker.tracks),
            "rows_moved": self._moved,
            "idle_closes": self._idle_closes,
            "remote_drafts": client.remote,
            "near_drafts": client.near,
            "near_followed": client.followed,
            "near_prior_version": client.prior_version,
            "fallback_drafts": client.fallback,
            "chains_continued": client.continued,
            "failed_calls": client.failures,
            "draft_calls": client.draft_calls,
            "draft_wait_ms_total": 1e3 * client.draft_wait_s,  # of the proposer's time: waiting on the service
            "deadline_ms": 1e3 * self._deadline.seconds,
            **self._cost.summary(),
            "steps_not_worth_drafting": self._unworthy,
            "chains": self._outcomes.summary(),
            **self._model_summary(),
            "recalibration": [round(f, 3) for f in self._outcomes.factors().tolist()],
            "commits_retried": client.commits_retried,
            "commits_dropped": client.commits_dropped,
            "commits_pending": client.commits_pending,
            "errors": self._errors,
        }

    def _model_summary(self) -> dict[str, Any]:
        """The draft model's part (none without one): the steps that proposed its chain, its
        tokens in them and how many were accepted, requests holding a model now, its
        per-request forward passes, the batch's reads (one per depth for all rows, where they
        share a forward), the rows that read nothing (the model's chain could not have paid)
        or waited for a price, those priced out whose reads were timed again, the tokens
        read, and the steps a new request is expected to run (by those that ended: what a
        prompt's read is charged over)."""
        if self._models is None:
            return {}
        return {
            "model_steps": self._model_steps,
            "model_proposed": self._model_proposed,
            "model_accepted": self._model_accepted,
            "model_rows_live": self._models.live,
            "model_forwards": self._models.forwards,
            "model_reads": self._models.reads,
            "model_skipped": self._models.skipped,
            "model_waited": self._models.waited,
            "model_retried": self._models.retried,
            "model_tokens_read": self._models.fed,
            "model_request_steps": round(self._models.steps.remaining(0), 1),
        }

    def _write_stats(self) -> None:
        self._stats_written = time.monotonic()
        if not self.settings.stats_path:
            return
        path = Path(self.settings.stats_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.stats()))
            tmp.replace(path)  # readers never see half a file
        except OSError as exc:
            logger.warning("draftcache proposer: cannot write %s: %s", path, exc)

    def shutdown(self) -> None:
        """Close every session with commit and the client's channel (at exit)."""
        if self.standby or self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            try:
                self._close(self._tracker.clear())
                self._client.shutdown()
            except Exception:
                logger.exception("draftcache proposer: shutdown failed")
            self._write_stats()
            if self._metrics is not None:
                self._metrics.close()


def drafts_read_here(vllm_config: Any) -> bool:
    """Whether vLLM reads the drafts of the proposer it builds with ``vllm_config``.

    vLLM builds a custom proposer on each worker of its last pipeline stage and takes every
    step's output, the drafts in it, from one worker: the first of that stage's
    tensor-parallel (times prefill-context-parallel) ranks (vLLM 0.32's
    ``MultiprocExecutor._get_output_rank``; its ``_is_driver_worker`` counts ranks alike).
    The stage's ranks start at a multiple of that group's size, so the worker whose rank is one
    is the one. A configuration without parallel settings is a single worker's.

    >>> from types import SimpleNamespace as Config
    >>> def worker(rank, tp, pcp=1):
    ...     return Config(parallel_config=Config(rank=rank, tensor_parallel_size=tp, prefill_context_parallel_size=pcp))
    >>> [drafts_read_here(worker(rank, tp=3)) for rank in range(6)]  # pipeline stages 0 and 1 of 3 ranks each
    [True, False, False, True, False, False]
    >>> drafts_read_here(worker(2, tp=2, pcp=2)), drafts_read_here(worker(4, tp=2, pcp=2))
    (False, True)
    >>> drafts_read_here(Config())
    True
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return True
    group = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "prefill_context_parallel_size", 1) or 1
    )
    return int(getattr(parallel, "rank", 0) or 0) % group == 0


def draft_models(vllm_config: Any, settings: EngineSettings, vocab_size: int) -> ModelRows:
    """The per-request draft models of ``settings.draft_model``, on the target's device and in
    its dtype (vLLM's ``device_config`` and ``model_config``; the CPU and float32 where a
    configuration lacks them), checked to read ``vocab_size`` ids. Imports torch and
    transformers, as vLLM's worker has."""
    from decoder_client.draft_model import drafters
    from decoder_client.engines.beside import ModelRows

    device = getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu"
    dtype = getattr(vllm_config.model_config, "dtype", None)
    make = drafters(
        settings.draft_model,
        int(vllm_config.speculative_config.num_speculative_tokens),
        vocab_size,
        device=str(device),
        **({} if dtype is None else {"dtype": dtype}),
    )
    return ModelRows(make, settings.draft_model_rows)


def tokenizer_fingerprint(model_config: Any) -> str:
    """The fingerprint of the engine's tokenizer (:mod:`indexer.fingerprint`), stated beside its
    vocabulary so that a namespace of another tokenizer of the same size refuses this model. ""
    (not stated, only the size is checked) where the engine loads no tokenizer or this one
    cannot be read as a Hugging Face tokenizer (a Mistral-format one, say)."""
    if getattr(model_config, "skip_tokenizer_init", False):
        return ""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            model_config.tokenizer,
            revision=getattr(model_config, "tokenizer_revision", None),
            trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)),
        )
        pieces = tok.convert_ids_to_tokens(list(range(min(len(tok), FINGERPRINT_IDS))))
        return fingerprint(piece or "" for piece in pieces)
    except Exception as exc:  # any loader's failure only leaves the tokenizer unstated
        logger.warning("draftcache: the tokenizer's pieces could not be read (%s); only its size is stated", exc)
        return ""


def ensure_namespace(
    config: ClientConfig, vocab_size: int, timeout_s: float = 60.0, stop: threading.Event | None = None
) -> None:
    """Create the namespace with the model's vocabulary (and ``config.tokenizer``'s
    fingerprint) unless the service has it, waiting up to ``timeout_s`` for the service, or
    until ``stop`` is set (the proposer shut down: nothing is logged). Best effort: a service
    that does not come, or a token that may not create namespaces, is logged (drafts are local
    until the service serves the namespace). One that exists with another tokenizer (another
    vocabulary, or another fingerprint) is logged as an error (the service refuses this model's
    calls there); one that exists with the tokenizer's own size, which the model pads, is used
    as it is, its fingerprint registered when it has none.

    The channel retries its connection every second at most (the client's reconnect settings):
    with gRPC's default backoff, which grows to two minutes, a service that comes up after a
    long first compile would be seen only after the wait is over."""
    deadline = time.monotonic() + timeout_s
    with config.channel() as channel:
        ready = grpc.channel_ready_future(channel)
        while not ready.done():  # connected, or a second passes: then look at ``stop`` again
            if stop is not None and stop.is_set():
                ready.cancel()
                return
            if time.monotonic() >= deadline:
                break  # the call below waits the least and says why
            with contextlib.suppress(grpc.FutureTimeoutError):
                ready.result(timeout=min(NAMESPACE_POLL_S, max(deadline - time.monotonic(), 0.0)))
        ready.cancel()
        admin = pb_grpc.AdminStub(channel)
        request = pb.CreateNamespaceRequest(name=config.namespace, vocab_size=vocab_size, tokenizer=config.tokenizer)
        timeout_s = max(deadline - time.monotonic(), NAMESPACE_POLL_S)
        try:
            admin.CreateNamespace(request, timeout=timeout_s, metadata=config.metadata, wait_for_ready=True)
        except grpc.RpcError as exc:  # the service says why
            level = logging.WARNING
            if exc.code() is grpc.StatusCode.ALREADY_EXISTS:  # with another vocabulary size or tokenizer
                level = logging.INFO if _padded_from(admin, config, vocab_size) else logging.ERROR
            logger.log(
                level, "draftcache: namespace %r not created (%s: %s)", config.namespace, exc.code(), exc.details()
            )


def _padded_from(admin: pb_grpc.AdminStub, config: ClientConfig, vocab_size: int) -> bool:
    """Whether the service's namespace has a vocabulary this model's may be padded from (or to):
    one tokenizer's (see :func:`~indexer.tokens.one_tokenizer`), and no other fingerprint. The
    model's fingerprint is registered with it when it has none (under its own size)."""
    from indexer.tokens import one_tokenizer

    try:
        listed = admin.Namespaces(pb.NamespacesRequest(), timeout=10, metadata=config.metadata).namespaces
        found = next((n for n in listed if n.name == config.namespace), None)
        if found is None or not one_tokenizer(found.vocab_size, vocab_size):
            return False
        if config.tokenizer and not found.tokenizer:
            request = pb.CreateNamespaceRequest(
                name=config.namespace, vocab_size=found.vocab_size, tokenizer=config.tokenizer
            )
            found = admin.CreateNamespace(request, timeout=10, metadata=config.metadata).namespace
    except grpc.RpcError:
        return False
    return not (config.tokenizer and found.tokenizer and found.tokenizer != config.tokenizer)


def _section(additional_config: Any) -> Mapping[str, Any]:
    """Our part of vLLM's ``additional_config`` (a dict, or an object of some other plugin)."""
    if not isinstance(additional_config, Mapping):
        return {}
    section = additional_config.get(SECTION, {})
    if not isinstance(section, Mapping):
        raise ValueError(f'additional_config["{SECTION}"] must be a mapping, got {type(section).__name__}')
    return section


def _session(track: Track) -> ClientSession:
    return cast("ClientSession", track.payload)  # every track the proposer drafts for has one

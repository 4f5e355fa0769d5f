"""draftcache as llama.cpp's draft model, through llama-cpp-python's ``LlamaDraftModel`` hook.

What the engine gives: ``Llama(..., draft_model=d)`` calls ``d(input_ids)`` once per
verification step with the whole sequence so far (the prompt, every accepted token and the
token just sampled; a view of the engine's own buffer), one sequence per ``Llama``. It
evaluates the ids returned in one batch and keeps them up to the first mismatch. What it does
not give: a request id, or a signal that a generation started or ended.

So :class:`DraftcacheDraftModel` keeps one draftcache session per generation and reads the rest
off the sequences: a call whose sequence is the previous one, then a prefix of the previous
draft, then one sampled token, continues the generation (only those tokens travel); anything
else starts a new one: the previous session is closed with commit and a new one is opened on
the sequence's prompt. The engine never waits on the service. By default the sessions live in a
near copy of the namespace in this process (:mod:`decoder_client.client.near`), which drafts
with no call and commits to the service in the background; with ``near=False`` they live on
the service: opens run in the background, each draft call has a deadline (with
:meth:`DraftcacheDraftModel.connect`, a fraction of the engine's recent step:
:mod:`~decoder_client.engines.deadline`), and past it the client's local fallback answers.

Where a generation ends: without help, only the next generation's first call shows it, and
the last step's tokens never reach the draft model. :meth:`DraftcacheDraftModel.attach` wraps
the ``Llama``'s ``generate`` (the method every completion and chat completion runs through),
so each generation's session is opened on its prompt before the prompt is evaluated and
closed with commit, with every generated token, the moment the generation stops (end of
text, ``max_tokens``, a stop string, a consumer that stops reading a stream). ``close()`` (or
``with``) commits the generation still open and shuts the client down.

A prompt's logits: with a draft model llama-cpp-python computes and copies the logits of every
position it evaluates, the prompt's included, because a verification step reads every drafted
position's. The prompt needs only its last. An attached model evaluates each generation's
prompt with the last position's logits alone (and writes them where the engine keeps them):
12% less time on an 1,800-token prompt on a 2-core CPU, all of it time before the first token.
The prompt's other positions then have no logits, which only ``logprobs`` with ``echo=True``
reads: ``attach(llm, prompt_logits=True)`` keeps them.

With ``topk`` set (``connect(..., topk=8)``) an attached model also sends the engine's own
top-k ids at every position the step verified, each after the token there: the one before the
tokens the call reports, then every token of the draft, the rejected ones included (read from
its logits, which llama.cpp keeps at every position when it has a draft model): they feed the
namespace's successor tier, as the reference decoder's do. It costs a partial sort of the
vocabulary per verified position, about a millisecond a step for SmolLM2.

llama-cpp-python's OpenAI-compatible server (``llama_cpp.server``) cannot be told to use it: its
``draft_model`` setting only ever builds the engine's own ``LlamaPromptLookupDecoding``
(``llama_cpp/server/model.py``). :mod:`decoder_client.engines.llamacpp_server` runs that server
with this draft model in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from decoder_client.chain_model import ChainSource
from decoder_client.client.drafting import Drafting
from decoder_client.client.session import TopkAt, TopkRows
from decoder_client.engines.beside import beside
from decoder_client.engines.deadline import StepDeadline
from decoder_client.engines.outcomes import ChainOutcomes
from decoder_client.engines.read_retry import ReadRetry
from decoder_client.engines.request_steps import RequestSteps
from decoder_client.engines.settings import EngineSettings
from decoder_client.engines.step_clock import StepClock
from decoder_client.engines.step_cost import StepCost, chain_to_propose
from indexer.drafter import MAX_DEPTH
from indexer.fingerprint import fingerprint_of

if TYPE_CHECKING:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    from decoder_client.client.metrics import ClientMetrics
else:

    def _hook_base() -> type:
        """The engine's hook class; without llama-cpp-python the module still imports (its
        docs, the doctest run) and the class is only useless."""
        try:
            from llama_cpp.llama_speculative import LlamaDraftModel
        except ModuleNotFoundError:
            return object
        return LlamaDraftModel

    LlamaDraftModel = _hook_base()

logger = logging.getLogger(__name__)


def accepted_drafts(previous: np.ndarray, draft: np.ndarray, sequence: np.ndarray) -> int | None:
    """How many tokens of ``draft`` the engine accepted, when ``sequence`` is the outcome of the
    step that drafted it (``previous``, then a prefix of ``draft``, then one sampled token);
    ``None`` when it is not (a new generation).

    >>> prev, draft = np.array([1, 2, 3]), np.array([4, 5, 6])
    >>> accepted_drafts(prev, draft, np.array([1, 2, 3, 4, 5, 9]))  # 4 and 5 accepted, 9 sampled
    2
    >>> accepted_drafts(prev, draft, np.array([1, 2, 3, 4, 5, 6, 7]))  # all three, then the bonus token
    3
    >>> accepted_drafts(prev, draft, np.array([1, 2, 3, 8]))  # none accepted
    0
    >>> accepted_drafts(prev, draft, np.array([1, 2, 3, 5, 9])) is None  # 5 was not drafted first
    True
    >>> accepted_drafts(prev, draft, np.array([1, 2, 7, 8])) is None  # another prompt
    True
    """
    n, grown = previous.size, sequence.size - previous.size
    if grown < 1 or grown - 1 > draft.size:
        return None
    if not (np.array_equal(sequence[:n], previous) and np.array_equal(sequence[n:-1], draft[: grown - 1])):
        return None
    return grown - 1


@dataclass
class DraftStats:
    """What the draft model's calls came to.

    A step is a verification whose outcome the next call showed (the last step of a generation
    is not counted); ``mean_accepted_tokens`` is per step, the sampled token included (1.0:
    no gain), as the project's MAT is.
    """

    generations: int = 0  # sessions opened
    calls: int = 0
    steps: int = 0
    proposed: int = 0  # draft tokens in the counted steps
    accepted: int = 0  # of those, accepted by the engine
    model_steps: int = 0  # of the counted steps, those that proposed the draft model's chain
    model_proposed: int = 0  # its tokens in them
    model_accepted: int = 0  # of those, accepted
    model_skipped: int = 0  # calls whose model read nothing: its chain could not have paid
    model_waited: int = 0  # ... or its prompt waited for a price
    model_retried: int = 0  # calls on which the model, priced out, had its reads timed again
    seconds: float = 0.0  # spent inside the calls: the client's work, the round trip, the draft model

    @property
    def mean_accepted_tokens(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 1.0

    @property
    def seconds_per_call(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0

    def counts(self) -> dict[str, float]:
        """The counts served as the engine's (:data:`~decoder_client.client.metrics.ENGINE_COUNTS`):
        llama.cpp keeps none of its own."""
        return {"steps": self.steps, "proposed": self.proposed, "accepted": self.accepted}


def _token_ids(input_ids: Any) -> np.ndarray:
    """The engine's sequence as a fresh int32 array (its buffer is overwritten later)."""
    ids = np.asarray(input_ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be a non-empty 1-D array of token ids, got {ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        raise ValueError("token ids must be in [0, 2**31)")
    return ids.astype(np.int32)


def _prompt_eval_hookable(llm: Any) -> bool:
    """Whether ``llm`` has the internals a prompt evaluated for its last logits alone goes
    through (llama-cpp-python 0.3: ``_logits_all``, read by ``eval`` per batch, and the
    context's ``get_logits``); another version keeps every position's logits."""
    return isinstance(getattr(llm, "_logits_all", None), bool) and hasattr(getattr(llm, "_ctx", None), "get_logits")


def flash_attention_off(llm: Any) -> bool:
    """Whether ``llm`` was made without flash attention (``Llama(..., flash_attn=False)``, the
    default). Then llama.cpp's CPU backend multiplies a batch's queries with the cached keys by
    another kernel than a one-token step's (llamafile's sgemm), whose rounding differs, and a
    verification step's greedy choice can part from plain decoding's at a near tie; with flash
    attention every query row is computed alike. False where this build does not say."""
    import llama_cpp

    disabled = getattr(llama_cpp, "LLAMA_FLASH_ATTN_TYPE_DISABLED", None)
    kind = getattr(getattr(llm, "context_params", None), "flash_attn_type", None)
    return disabled is not None and kind == disabled


def llama_fingerprint(llm: Any) -> str:
    """The fingerprint of a loaded ``Llama``'s tokenizer (:mod:`indexer.fingerprint`): the
    pieces its GGUF file lists, which are the Hugging Face tokenizer's. "" (not stated) where
    this build of llama-cpp-python cannot list them."""
    try:
        return fingerprint_of(llm._model.token_get_text, int(llm.n_vocab()))
    except (AttributeError, UnicodeDecodeError) as exc:
        logger.warning("draftcache: this Llama's tokenizer pieces could not be read (%s); not stated", exc)
        return ""


class DraftcacheDraftModel(LlamaDraftModel):
    """A ``LlamaDraftModel`` drafting with draftcache: chains of at most ``num_pred_tokens``
    ids, one session per generation (see the module's docstring).

    The client is injected (its deadline, fallback and chain settings are the caller's); with
    :meth:`connect` the model builds its own client in chain mode and shuts it down on
    :meth:`close`.

    >>> llm = Llama(model_path=GGUF, logits_all=True)  # doctest: +SKIP
    >>> vocab, tokenizer = llm.n_vocab(), llama_fingerprint(llm)  # doctest: +SKIP
    >>> draft = DraftcacheDraftModel.connect(  # doctest: +SKIP
    ...     "127.0.0.1:50051", "smollm2", vocab_size=vocab, tokenizer=tokenizer
    ... )
    >>> draft.attach(llm)  # doctest: +SKIP
    >>> llm("Q: name the planets. A:", max_tokens=64, temperature=0.0)  # doctest: +SKIP
    >>> draft.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        client: Drafting,
        *,
        num_pred_tokens: int = 10,
        owns_client: bool = False,
        deadline: StepDeadline | None = None,
        cost: StepCost | None = None,
        idle_s: float = 2.0,
        recalibrate: bool = False,
        chain_model: ChainSource | None = None,
        clock: StepClock | None = None,
    ) -> None:
        if not 1 <= num_pred_tokens <= MAX_DEPTH:
            raise ValueError(f"num_pred_tokens must be in [1, {MAX_DEPTH}], got {num_pred_tokens}")
        self.client = client
        self.deadline = deadline  # None: the client's own, every call
        self.cost = cost  # where chains are cut (None: where the service cut them)
        # A longer gap between calls than idle_s is a pause, not a step. ``clock``: another
        # source of the steps' times (an offline replay's, benchmarks.proposer_replay).
        self._clock = StepClock(idle_s) if clock is None else clock
        self.topk = client.config.topk  # the engine's top-k sent back per verified position (0: none)
        self._llm: Any = None  # the attached engine, whose logits the top-k come from
        self.num_pred_tokens = num_pred_tokens
        self.stats = DraftStats()
        self._owns_client = owns_client
        self._session: Any = None  # the open generation's session (what the client's open returned)
        self._sequence = np.zeros(0, dtype=np.int32)  # what the session holds
        self._draft: np.ndarray | None = None  # the last call's proposal, its outcome not yet seen
        self._claims = np.zeros(0)  # ... and its tokens' scores as the service claimed them
        self.outcomes = ChainOutcomes()  # how the proposals fared: with ``recalibrate``, what corrects the claims
        self.recalibrate = recalibrate
        self.chain_model = chain_model  # a small model drafting beside the cache (decoder_client.chain_model)
        self._model_draft = False  # whether the last proposal was the model's
        self._model_seconds = 0.0  # the model's part of the last call (its reads)
        self.request_steps = RequestSteps()  # how long generations run: what the model's read of a prompt serves
        self._age = 0  # the steps the open generation has drafted
        self.read_retry = ReadRetry()  # when the model, priced out, has its reads timed again
        self._metrics: ClientMetrics | None = None  # the client's counts served (settings' metrics_port)

    @classmethod
    def connect(
        cls,
        target: str,
        namespace: str,
        *,
        num_pred_tokens: int = 10,
        vocab_size: int | None = None,
        tokenizer: str = "",
        chain_model: ChainSource | None = None,
        **settings: Any,
    ) -> DraftcacheDraftModel:
        """A draft model with a client of its own, drafting chains of at most
        ``num_pred_tokens`` tokens (chain mode); ``settings``: any other
        :class:`~decoder_client.engines.settings.EngineSettings` (``deadline_s``,
        ``chain_min_prob``, ``token``, ``near``, ...), as vLLM's proposer takes them.
        ``vocab_size``: the model's (``llm.n_vocab()``), which the near copy it drafts from by
        default needs (with ``near=False`` each step asks the service instead). ``tokenizer``:
        its tokenizer's fingerprint (:func:`llama_fingerprint`), stated beside it, so that a
        namespace of another tokenizer of the same size refuses this model ("": not stated).
        ``chain_model``: a small model drafting beside the cache
        (:class:`~decoder_client.engines.llamacpp_chains.LlamaChainModel`): each step proposes
        its chain unless more of the cache's is expected to be accepted."""
        settings_ = EngineSettings(target=target, namespace=namespace, **settings)
        return cls.from_settings(settings_, num_pred_tokens, vocab_size, tokenizer=tokenizer, chain_model=chain_model)

    @classmethod
    def from_settings(
        cls,
        settings: EngineSettings,
        num_pred_tokens: int = 10,
        vocab_size: int | None = None,
        *,
        tokenizer: str = "",
        chain_model: ChainSource | None = None,
    ) -> DraftcacheDraftModel:
        """See :meth:`connect`; each call's deadline follows the engine's step."""
        client = settings.draft_client(num_pred_tokens, vocab_size, tokenizer)
        model = cls(
            client,
            num_pred_tokens=num_pred_tokens,
            owns_client=True,
            deadline=settings.step_deadline(),
            cost=settings.step_cost(),
            idle_s=settings.idle_close_s,
            recalibrate=settings.recalibrate,
            chain_model=chain_model,
        )
        model._metrics = settings.client_metrics(client, "llama.cpp", model.stats.counts)
        return model

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> np.ndarray:
        """The draft for the sequence ``input_ids``: at most ``num_pred_tokens`` ids (intc)."""
        start = time.perf_counter()
        ids = _token_ids(input_ids)
        last_draft = self._draft
        session, new = self._continue(ids)
        interval = self._clock.tick(start)
        if self.cost is not None and interval is not None:
            # The step verified the last call's draft; the first of a generation (no draft
            # before it) evaluated its prompt and is not a step of the cost line.
            proposed = 0 if last_draft is None else last_draft.size
            counted = session is not None and last_draft is not None
            # The draft model's reads are the proposer's time, priced by the beside rule itself.
            engine_s = interval - self._model_seconds
            self.cost.record(engine_s, proposed, rows=1, produced=new.size, counted=counted)
        verified = last_draft if session is not None else None  # the draft this step verified
        if session is None:  # a new generation: its prompt is all but the token just sampled
            session, new = self.begin(ids[:-1]), ids[-1:]
        deadline = None
        if self.deadline is not None:
            self.deadline.step(interval)
            deadline = self.deadline.seconds
        topk = None
        if self.topk and self._llm is not None and 0 < new.size < ids.size:
            topk = [self.verified_topk(ids, new, verified)]
        (tree,) = self.client.draft([session], [new.tolist()], topk, deadline_s=deadline)
        min_prob = 0.0 if self.cost is None else self.cost.ask_prob
        chances = self.outcomes.chances if self.recalibrate else None
        chain, claims, scores = chain_to_propose(tree, self.num_pred_tokens, min_prob, chances)
        self._model_draft, self._model_seconds = False, 0.0
        if self.chain_model is not None:
            reading = time.perf_counter()
            serves = self.request_steps.remaining(self._age)
            proposal = beside(
                self.chain_model,
                ids,
                chain,
                claims,
                scores,
                self.num_pred_tokens,
                min_prob,
                self.cost,
                serves,
                self.read_retry,
            )
            self._model_seconds = time.perf_counter() - reading
            chain, claims, scores, self._model_draft = proposal.chain, proposal.claims, proposal.scores, proposal.model
            self.stats.model_skipped += proposal.unread and not proposal.waited
            self.stats.model_waited += proposal.waited
            self.stats.model_retried += proposal.retried
        if self.cost is not None:  # what the step pays for, its own cost included (none where nothing pays)
            (n,) = self.cost.keep([scores])
            chain, claims = chain[:n], claims[:n]
        chain = chain.astype(np.intc)
        self._age += 1
        self._sequence, self._draft, self._claims = ids, chain, claims[: chain.size]
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return chain

    def _continue(self, ids: np.ndarray) -> tuple[Any, np.ndarray]:
        """The open generation's session and the tokens ``ids`` adds to it (the step they end
        is counted); no session when ``ids`` does not continue it."""
        none = np.zeros(0, dtype=np.int32)
        if self._session is None:
            return None, none
        accepted = accepted_drafts(self._sequence, none if self._draft is None else self._draft, ids)
        if accepted is None:
            return None, none
        if self._draft is not None:
            self.stats.steps += 1
            self.stats.proposed += self._draft.size
            self.stats.accepted += accepted
            if self._model_draft:
                self.stats.model_steps += 1
                self.stats.model_proposed += self._draft.size
                self.stats.model_accepted += accepted
            else:
                self.outcomes.record(self._claims, accepted)
        return self._session, ids[self._sequence.size :]

    def verified_topk(self, ids: np.ndarray, new: np.ndarray, draft: np.ndarray | None) -> TopkRows:
        """The engine's top-k at every position the step verified: after the token before the
        ``new`` ones, then after each token of the ``draft`` it verified, the rejected ones
        included (llama.cpp evaluates a whole draft in one batch and keeps every position's
        logits until it evaluates again; the next evaluation comes after this call). Without a
        draft, the rows that produced the new tokens."""
        start = ids.size - new.size - 1
        if draft is None or not draft.size or start + 1 + draft.size > self._llm.n_ctx():
            return self.target_topk(start, ids.size - 1)
        after = np.concatenate((ids[start : start + 1], draft)).astype(np.int32)
        return TopkAt(after, self.target_topk(start, start + after.size))

    def target_topk(self, start: int, stop: int) -> np.ndarray:
        """The attached engine's top-k ids (likeliest first) at positions ``start`` to
        ``stop - 1``: the distributions it sampled the tokens after them from (with a draft
        model llama.cpp keeps every position's logits)."""
        scores = self._llm.scores[start:stop]
        k = self.topk
        part = np.argpartition(scores, -k, axis=1)[:, -k:]
        order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
        return np.take_along_axis(part, order, axis=1).astype(np.int32)

    def begin(self, prompt: Sequence[int] | np.ndarray) -> Any:
        """Start a generation on ``prompt`` (the one open is committed first). The session
        opens in the background: the first steps draft locally if the service is slow."""
        self.finish()
        ids = np.array(prompt, dtype=np.int32)
        if self.cost is not None:
            self.client.cut_chains_at(self.cost.ask_prob)  # the service picks chains for this cut
        (session,) = self.client.open([ids], wait=False)
        self._session, self._sequence, self._draft = session, ids, None
        self.stats.generations += 1
        return session

    def finish(self, sequence: Sequence[int] | np.ndarray | None = None) -> None:
        """End the open generation, if any, and commit it. ``sequence``: the generation's final
        tokens (prompt included); what the session has not heard of them goes with the close."""
        session, self._session = self._session, None
        self.request_steps.ended(self._age)
        self._age = 0
        if session is None:
            return
        if sequence is not None:
            final = np.asarray(sequence, dtype=np.int32)
            n = self._sequence.size
            if final.size > n and np.array_equal(final[:n], self._sequence):
                self.client.add_tokens([session], [final[n:].tolist()])
        self.client.close([session], commit=True)
        self._sequence, self._draft = np.zeros(0, dtype=np.int32), None

    def attach(self, llm: Llama, *, prompt_logits: bool = False) -> Llama:
        """Mark ``llm``'s generations out exactly (see the module's docstring): its
        ``generate`` is wrapped on this instance, and unless ``prompt_logits`` its ``eval``
        too, so that a generation's prompt is evaluated for its last position's logits alone.
        ``llm`` becomes this model's engine: made with ``draft_model=self`` or with none (then
        this becomes its draft model, as ``Llama(draft_model=...)`` sets it), and with
        ``logits_all=True``: with a draft model llama-cpp-python (0.3.36) keeps every
        position's logits, in a buffer sized by ``logits_all`` alone, so without it a prompt
        longer than ``n_batch`` fails in the engine's ``eval``. Made without flash attention it
        is attached with a warning (:func:`flash_attention_off`)."""
        if llm.draft_model is not None and llm.draft_model is not self:
            raise ValueError("this Llama has another draft model: make it with draft_model=None or this one")
        if llm.scores.shape[0] < llm.n_ctx():
            raise ValueError("make the Llama with logits_all=True: its logits buffer is too small for a draft model")
        if self.chain_model is not None and self.chain_model.vocab_size < llm.n_vocab():
            raise ValueError(
                f"the chain model reads {self.chain_model.vocab_size} ids; this Llama's vocabulary has {llm.n_vocab()}"
            )
        if flash_attention_off(llm):
            logger.warning(
                "this Llama computes attention without flash attention: its verification steps may part from plain "
                "greedy decoding at near ties (make it with flash_attn=True)"
            )
        llm.draft_model = self  # what its generate reads
        self._llm = llm
        inner = llm.generate
        prompt_pending = [False]  # the wrapped generate's next eval is its prompt's
        if not prompt_logits and _prompt_eval_hookable(llm):
            inner_eval = llm.eval

            def eval(tokens: Sequence[int]) -> None:
                if not prompt_pending[0]:
                    return inner_eval(tokens)
                prompt_pending[0] = False
                llm._logits_all = False  # each batch's last position only
                try:
                    inner_eval(tokens)
                finally:
                    llm._logits_all = True
                if len(tokens):  # (an exact cache hit evaluates nothing)
                    last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                    llm.scores[llm.n_tokens - 1, :] = last

            llm.__dict__["eval"] = eval

        def generate(tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Sequence[int] | None, None]:
            sequence = [int(t) for t in tokens]
            self.begin(sequence)
            prompt_pending[0] = True
            steps = inner(tokens, *args, **kwargs)
            try:
                sent: Sequence[int] | None = None
                while True:
                    token = steps.send(sent)  # the first send is None
                    sequence.append(token)
                    sent = yield token
                    if sent:
                        sequence.extend(int(t) for t in sent)
            except StopIteration:
                return
            finally:
                prompt_pending[0] = False
                steps.close()
                self.finish(sequence)

        llm.__dict__["generate"] = generate  # this instance's completions now run through it
        return llm

    def close(self) -> None:
        """Commit the generation still open; shut the client down if this model made it."""
        self.finish()
        if self._owns_client:
            self.client.shutdown()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def __enter__(self) -> DraftcacheDraftModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

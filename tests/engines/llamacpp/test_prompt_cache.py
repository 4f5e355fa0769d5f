"""The engine benchmark's prompt cache on the real engine: a prompt asked again starts from the
state its last generation left, evaluates only its last token, and decodes as from scratch."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.engines_llamacpp import PromptCache, greedy
from tests.engines.llamacpp.conftest import QUESTIONS, chat_ids

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


def _counting_evals(llm: Any) -> list[int]:
    """The sizes of the batches ``llm`` evaluates from now on."""
    sizes: list[int] = []
    inner = llm.eval

    def eval(tokens: Any) -> None:
        sizes.append(len(tokens))
        inner(tokens)

    llm.eval = eval
    return sizes


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "prompt-lookup"])
def test_a_prompt_asked_again_evaluates_its_last_token_alone_and_decodes_alike(make_llama, drafting: bool) -> None:  # type: ignore[no-untyped-def]
    if drafting:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        llm = make_llama(LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=10))
    else:
        llm = make_llama()
    cache = PromptCache(64 << 20)
    prompt = chat_ids(llm, QUESTIONS[0])
    llm.reset()
    first = greedy(llm, prompt, 24)
    cache.keep(llm, prompt)
    other = chat_ids(llm, QUESTIONS[2])  # another request in between, as in a workload
    llm.reset()
    greedy(llm, other, 8)
    cache.keep(llm, other)

    sizes = _counting_evals(llm)
    assert cache.restore(llm, prompt) and cache.hits == 1
    again = greedy(llm, prompt, 24)
    assert sizes[0] == 1  # the prompt's last token, for its logits; the rest came from the cache
    assert again == first
    assert 0 < cache.size_bytes <= 64 << 20


def test_nothing_is_kept_past_its_capacity_and_the_oldest_goes_first(make_llama) -> None:  # type: ignore[no-untyped-def]
    llm = make_llama()
    prompts = [chat_ids(llm, q) for q in QUESTIONS[:2]]
    tiny = PromptCache(1024)  # smaller than any prompt's state
    llm.reset()
    greedy(llm, prompts[0], 4)
    tiny.keep(llm, prompts[0])
    assert tiny.size_bytes == 0 and not tiny.restore(llm, prompts[0])

    sizes = []
    for p in prompts:  # each state's size alone
        llm.reset()
        greedy(llm, p, 4)
        alone = PromptCache(1 << 30)
        alone.keep(llm, p)
        sizes.append(alone.size_bytes)
    both = PromptCache(sum(sizes) - 1)  # room for either state, not for both: the second pushes the first out
    for p in prompts:
        llm.reset()
        greedy(llm, p, 4)
        both.keep(llm, p)
    assert both.size_bytes == sizes[1]
    assert not both.restore(llm, prompts[0]) and both.restore(llm, prompts[1])

"""Verification forwards timed by size, per variant, on a real (tiny) model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from transformers import LlamaForCausalLM

from decoder_client.forward_timing import forward_seconds


def test_every_variant_is_timed_at_every_size_and_set_before_each_forward(
    tiny_llama: Callable[[str], LlamaForCausalLM],
) -> None:
    model = tiny_llama("sdpa")
    calls: Counter[str] = Counter()
    variants = {"a": lambda: calls.update(["a"]), "b": lambda: calls.update(["b"])}
    seconds = forward_seconds(model, (1, 2, 5), context=16, repeats=2, variants=variants)
    assert set(seconds) == {"a", "b"} and all(list(s) == [1, 2, 5] for s in seconds.values())
    assert all(t > 0 for s in seconds.values() for t in s.values())
    assert calls == {"a": 6, "b": 6}  # 3 sizes x 2 rounds each
    assert list(forward_seconds(model, (1, 4), context=8, repeats=1)) == [""]  # no variants: one, unnamed


def test_the_context_is_cut_to_the_model_s_positions(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    model.config.max_position_embeddings = 40
    assert list(forward_seconds(model, (1, 8), context=512, repeats=1)[""]) == [1, 8]  # 32 of context, not 512
    with pytest.raises(ValueError, match="40 positions cannot run a forward of 64"):
        forward_seconds(model, (64,), repeats=1)


def test_bad_sizes_and_counts_are_refused(tiny_llama: Callable[[str], LlamaForCausalLM]) -> None:
    model = tiny_llama("sdpa")
    for sizes, context, repeats in (((), 8, 1), ((0, 1), 8, 1), ((1,), 0, 1), ((1,), 8, 0)):
        with pytest.raises(ValueError):
            forward_seconds(model, sizes, context=context, repeats=repeats)

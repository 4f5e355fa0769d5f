"""Timing a model's verification forwards by the tokens they carry, as the tree decoder sends them.

Both the cost curve the decoder cuts its trees by (:class:`decoder_client.cost_model.CostCurve`)
and the choice of matrix kernel per forward size (:func:`decoder_client.cpu_linears.tune_linears`)
rest on the same measurement: a forward of ``n`` query tokens (the root and a chain of ``n - 1``
nodes, with the tree mask and positions) against a KV cache of a realistic length, the fastest of
a few rounds, since other work on the machine only ever adds time. Sizes and variants are
interleaved within each round, so a burst of other work slows one round of all of them rather
than every round of one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from decoder_client.reference_decoder import cache_keyword, prune_cache
from decoder_client.tree_attention import tree_attention_mask, tree_position_ids

# Small blocks one by one: on CPUs, 2 or 3 query tokens can cost more than 4 (kernel choice).
SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def forward_seconds(
    model: torch.nn.Module,
    sizes: Sequence[int],
    *,
    context: int = 512,
    repeats: int = 3,
    variants: Mapping[str, Callable[[], None]] | None = None,
) -> dict[str, dict[int, float]]:
    """The fastest of ``repeats`` verification forwards of each size in ``sizes``, per variant.

    A variant is a name and a setter called before each of its forwards (a kernel choice, for
    instance); by default one variant, ``""``, that changes nothing. Returns seconds by variant,
    then by size.

    >>> forward_seconds(model, (1, 2, 4))[""]  # doctest: +SKIP
    {1: 0.031, 2: 0.033, 4: 0.034}
    """
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive token counts, got {list(sizes)}")
    if context < 1 or repeats < 1:
        raise ValueError(f"context and repeats must be >= 1, got {context} and {repeats}")
    chosen = dict(variants) if variants else {"": lambda: None}
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    config = getattr(model, "config").get_text_config()  # noqa: B009 - nn.Module has no config
    vocab = int(config.vocab_size)
    context = _within_positions(context, max(sizes), getattr(config, "max_position_embeddings", None))
    ids = torch.randint(0, vocab, (1, context + max(sizes)), device=device)
    best = {name: dict.fromkeys(sizes, float("inf")) for name in chosen}
    with torch.inference_mode():
        cache, cache_arg = DynamicCache(), cache_keyword(model)
        model(input_ids=ids[:, :context], **{cache_arg: cache}, use_cache=True)
        for _ in range(repeats):
            for n in sizes:
                chain = np.arange(-1, n - 2, dtype=np.int32)  # the root plus n - 1 nodes
                mask = tree_attention_mask(chain, context, dtype, device)
                positions = tree_position_ids(chain, context, device)
                for name, choose in chosen.items():
                    choose()
                    start = time.perf_counter()
                    model(
                        input_ids=ids[:, context : context + n],
                        attention_mask=mask,
                        position_ids=positions,
                        **{cache_arg: cache},
                        use_cache=True,
                    )
                    best[name][n] = min(best[name][n], time.perf_counter() - start)
                    prune_cache(cache, context, [])  # back to the context alone
    return best


def _within_positions(context: int, largest: int, positions: int | None) -> int:
    """``context`` cut so that the largest forward stays within a model of ``positions``
    positions (one with learned position embeddings has none beyond them).

    >>> _within_positions(512, 64, 2048), _within_positions(512, 64, 256), _within_positions(512, 64, None)
    (512, 192, 512)
    """
    if positions is None:
        return context
    if positions <= largest:
        raise ValueError(f"a model of {positions} positions cannot run a forward of {largest} tokens after a context")
    return min(context, positions - largest)

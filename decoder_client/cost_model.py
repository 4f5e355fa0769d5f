"""Cost-aware verification: how many draft tokens are worth verifying this step.

On a GPU, verifying 64 tokens costs about as much as decoding one; on a CPU it does not. The
cost curve of the actual device is measured once (forward passes of 1, 2, 4, ... query tokens
against a KV cache of a realistic length), and each step keeps the prefix of the tree (its nodes
best score first, which is always a valid subtree) that maximises expected tokens per second:
``(1 + sum of kept scores) / cost(kept + 1)``, scores being the drafter's estimated acceptance
probabilities. A weak tree shrinks to a token or two, or to nothing, so speculation never costs
more than it is expected to return.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from indexer.tree_builder import DraftTree

SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostCurve:
    """Seconds per forward pass by query-block size (interpolated between measured sizes)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes or any(s <= 0 for s in self.seconds):
            raise ValueError("a cost curve needs one positive time per size")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] != 1:
            raise ValueError("sizes must be increasing and start at 1")

    def cost(self, n: np.ndarray | int) -> np.ndarray:
        return np.asarray(np.interp(n, self.sizes, self.seconds))

    @classmethod
    def measure(cls, model: torch.nn.Module, *, context: int = 512, repeats: int = 3) -> CostCurve:
        """Time forward passes of each size on ``model``'s device after a ``context``-token prefill."""
        device = next(model.parameters()).device
        vocab = int(getattr(model, "config").get_text_config().vocab_size)  # noqa: B009 - nn.Module has no config
        ids = torch.randint(0, vocab, (1, context + max(SIZES)), device=device)
        seconds = []
        with torch.inference_mode():
            for n in SIZES:
                best = float("inf")
                for _ in range(repeats):
                    out = model(input_ids=ids[:, :context], use_cache=True)
                    start = time.perf_counter()
                    model(input_ids=ids[:, context : context + n], past_key_values=out.past_key_values, use_cache=True)
                    best = min(best, time.perf_counter() - start)
                seconds.append(best)
        return cls(SIZES, tuple(seconds))


def best_subtree(tree: DraftTree, curve: CostCurve) -> DraftTree:
    """The prefix of ``tree`` (best scores first) with the most expected tokens per second.

    >>> curve = CostCurve((1, 2, 4), (1.0, 1.1, 4.0))
    >>> t = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, 0, 1], np.int32),
    ...               np.zeros(3, np.uint8), np.array([0.9, 0.5, 0.1], np.float32))
    >>> best_subtree(t, curve).tokens.tolist()  # (1 + 0.9) / 1.1 beats 1 / 1.0 and (1 + 1.4) / 2.55
    [5]
    """
    if len(tree) == 0:
        return tree
    # A node is worth at most its parent (it is only verified through it), so the best-first
    # order always lists parents before children and every prefix is a tree.
    worth = tree.scores.astype(np.float64)
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0 and worth[i] > worth[p]:
            worth[i] = worth[p]
    order = np.argsort(-worth, kind="stable")
    gain = 1.0 + np.concatenate(([0.0], np.cumsum(worth[order])))
    rate = gain / curve.cost(np.arange(1, len(tree) + 2))  # k kept nodes: k + 1 query tokens
    keep = np.sort(order[: int(np.argmax(rate))])
    remap = np.full(len(tree), -1, dtype=np.int32)
    remap[keep] = np.arange(keep.size, dtype=np.int32)
    parents = tree.parents[keep]
    return DraftTree(
        tree.tokens[keep],
        np.where(parents >= 0, remap[np.maximum(parents, 0)], -1).astype(np.int32),
        tree.sources[keep],
        tree.scores[keep],
    )


def cost_aware(drafter: Callable[[np.ndarray], DraftTree], curve: CostCurve) -> Callable[[np.ndarray], DraftTree]:
    """Wrap a reference-decoder drafter so every tree is cut to its most profitable prefix."""

    def draft(context: np.ndarray) -> DraftTree:
        return best_subtree(drafter(context), curve)

    return draft

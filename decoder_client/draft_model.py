"""A small draft model beside the cache: its greedy chains, and each step the likelier of its
chain and the cache's.

Chains lose to trees at their first token: a chain has one, a tree hedges. A small causal LM
that reads the target's ids (the same tokenizer) knows the next token where the cache's memory
does not, and the cache knows long verbatim runs where the model is unsure; on agent traffic
each is right where the other is not (docs/MEASUREMENTS.md, "Chains beside a draft model").
:class:`BesideCache` proposes, each step, the chain whose first token is likelier: the model's
by the probability it gives its own first token, the cache's by its calibrated chance (the
reach of its roots, which every draft carries as its scores). The rule has no parameter; the
replay of the same rule is :class:`benchmarks.draft_model_replay.WithDraftModel`.

The model costs one forward per step over the tokens it has not seen (the step's accepted ones
and the bonus token), and ``k - 1`` more only on the steps its chain is proposed. It keeps its
own KV cache along the request: tokens it drafted and the target accepted are already in it, and
a context that went elsewhere (another request, a rejected draft) crops the cache back to what
the two share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from decoder_client.reference_decoder import VerifiedTopk, cache_keyword, prune_cache
from indexer.drafter import MAX_DEPTH
from indexer.tokens import as_tokens
from indexer.tree_builder import DraftTree, Tier

Drafter = Callable[[np.ndarray], DraftTree]

# The model's chain continues the request's own text, as the model reads it: it is labelled
# with the context tier, the nearest of the cache's tiers. Nothing downstream calibrates on it.
MODEL_TIER = Tier.CONTEXT


def first_token_chance(tree: DraftTree) -> float:
    """The chance that a draft's first token is right: its roots are distinct guesses at the
    same position, so their reaches add up.

    >>> tree = DraftTree(np.array([5, 6, 7], np.int32), np.array([-1, 0, -1], np.int32),
    ...                  np.zeros(3, np.uint8), np.array([0.5, 0.4, 0.25], np.float32))
    >>> first_token_chance(tree)
    0.75
    >>> first_token_chance(DraftTree.empty())
    0.0
    """
    if len(tree) == 0:
        return 0.0
    return float(min(1.0, float(tree.scores[tree.parents == -1].sum())))


@dataclass(frozen=True)
class NextToken:
    """The model's greedy next token after a context, and the probability it gives it."""

    token: int
    prob: float


class ModelDrafter:
    """Greedy chains of at most ``k`` tokens from a causal LM that reads the target's ids.

    :meth:`first` reads a context and gives the model's next token; :meth:`extend` goes on from
    it to a whole chain. A context longer than the model's positions allow (with room for the
    chain) gets no token: the cache drafts alone there.

    >>> drafter = ModelDrafter(small_model, k=8)  # doctest: +SKIP
    >>> drafter.chain(np.array(prompt_ids, np.int32)).tolist()  # doctest: +SKIP
    [504, 1345, 30, 2]
    """

    def __init__(self, model: PreTrainedModel, k: int, *, device: str = "cpu") -> None:
        if not 1 <= k <= MAX_DEPTH:
            raise ValueError(f"k must be in [1, {MAX_DEPTH}], got {k}")
        self.device = torch.device(device)
        module: torch.nn.Module = model  # PreTrainedModel.to's wrapper confuses type checkers
        module.to(self.device)
        self.model = model.eval()
        self.k = k
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.max_positions: int | None = getattr(text, "max_position_embeddings", None)
        self._keyword = cache_keyword(model)
        self._cache = DynamicCache(config=model.config)
        self._seen = np.zeros(0, dtype=np.int32)  # the ids whose keys and values the cache holds
        self._next: NextToken | None = None  # what first() gave for the context it last read
        self.forwards = 0  # forward passes, for what drafting cost
        self.fed = 0  # tokens those passes read

    def first(self, context: np.ndarray) -> NextToken | None:
        """The model's next token after ``context`` (int32 ids), or ``None`` where the context
        and a chain of ``k`` would not fit the model's positions."""
        ctx = as_tokens(context, self.vocab_size, what="context")
        if ctx.size == 0:
            raise ValueError("context must not be empty")
        self._next = None
        if self.max_positions is not None and ctx.size + self.k > self.max_positions:
            self.reset()
            return None
        shared = _shared_prefix(self._seen, ctx)
        shared = min(shared, ctx.size - 1)  # the last token is fed again for its logits
        if shared < self._seen.size:
            prune_cache(self._cache, shared, [])  # keep what the two share, full-attention layers only
        probs = self._forward(ctx[shared:])
        self._seen = ctx.copy()
        token = int(torch.argmax(probs))
        self._next = NextToken(token, float(probs[token]))
        return self._next

    def extend(self) -> tuple[np.ndarray, np.ndarray]:
        """The chain from the token :meth:`first` last gave, greedy up to ``k`` tokens, and the
        probability the model gave each of its tokens."""
        if self._next is None:
            raise RuntimeError("no next token to extend: call first() with a context that fits")
        tokens, probs = [self._next.token], [self._next.prob]
        while len(tokens) < self.k:
            p = self._forward(np.array(tokens[-1:], dtype=np.int32))
            self._seen = np.append(self._seen, np.int32(tokens[-1]))
            token = int(torch.argmax(p))
            tokens.append(token)
            probs.append(float(p[token]))
        self._next = None
        return np.array(tokens, dtype=np.int32), np.array(probs, dtype=np.float32)

    def chain(self, context: np.ndarray) -> np.ndarray:
        """The model's greedy chain of ``k`` after ``context``; empty where it does not fit."""
        if self.first(context) is None:
            return np.zeros(0, dtype=np.int32)
        return self.extend()[0]

    def reset(self) -> None:
        """Forget the cache (a new request shares nothing with the last)."""
        self._cache = DynamicCache(config=self.model.config)
        self._seen = np.zeros(0, dtype=np.int32)
        self._next = None

    def _forward(self, ids: np.ndarray) -> torch.Tensor:
        """Feed ``ids`` after what the cache holds; the next-token distribution after them."""
        tensor = torch.from_numpy(ids.astype(np.int64)).unsqueeze(0).to(self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=tensor, **{self._keyword: self._cache}, use_cache=True, logits_to_keep=1
            ).logits
        self.forwards += 1
        self.fed += int(ids.size)
        return torch.softmax(logits[0, -1].float(), dim=-1)


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share.

    >>> _shared_prefix(np.array([1, 2, 3], np.int32), np.array([1, 2, 4, 5], np.int32))
    2
    """
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class BesideCache:
    """A reference-decoder drafter: the cache's drafts (``cache``, any drafter) beside a draft
    model's chains. Each step proposes the model's chain unless the cache's first token is
    likelier than the model's; where the cache has nothing (it is empty there, or down and its
    client fell back), the model's chain goes. The cache is asked every step, so its session
    follows the request whichever draft is verified.

    >>> drafter = BesideCache(cache_drafter, ModelDrafter(small_model, k=8))  # doctest: +SKIP
    >>> tokens, stats = ReferenceDecoder(target).generate(ids, 128, drafter=drafter)  # doctest: +SKIP
    >>> drafter.model_steps / drafter.steps  # doctest: +SKIP
    0.64
    """

    def __init__(self, cache: Drafter, model: ModelDrafter) -> None:
        self.cache = cache
        self.model = model
        self.steps = 0
        self.model_steps = 0  # steps that proposed the model's chain
        self.accepted = {"model": 0, "cache": 0}  # accepted draft tokens by whose draft it was
        self._last: tuple[DraftTree, str, int] | None = None  # the last draft, whose, at what length

    def __call__(self, context: np.ndarray) -> DraftTree:
        self._count(context)
        ours = self.cache(context)
        nxt = self.model.first(context)
        self.steps += 1
        if nxt is None or (len(ours) and nxt.prob < first_token_chance(ours)):
            self._last = (ours, "cache", int(context.size))
            return ours
        self.model_steps += 1
        tokens, probs = self.model.extend()
        chain = DraftTree.chain(tokens, MODEL_TIER)
        tree = DraftTree(chain.tokens, chain.parents, chain.sources, np.cumprod(probs).astype(np.float32))
        self._last = (tree, "model", int(context.size))
        return tree

    def _count(self, context: np.ndarray) -> None:
        """Credit the last draft with what the target accepted of it (all the new tokens but the
        last, the step's own); a context that did not grow from it is another request."""
        if self._last is not None:
            tree, whose, at = self._last
            if context.size > at:
                self.accepted[whose] += len(tree.accept(context[at:-1]))
        self._last = None

    def observe_topk(self, verified: VerifiedTopk) -> None:
        """Passed on to the cache's drafter, if it takes the target's top-k."""
        observe = getattr(self.cache, "observe_topk", None)
        if observe is not None:
            observe(verified)

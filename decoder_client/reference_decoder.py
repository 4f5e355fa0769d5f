"""Reference speculative decoder for Hugging Face causal LMs: one forward verifies a whole tree.

Each step feeds ``[root] + tree nodes`` (the root is the last emitted token, not yet in the KV
cache) with the mask and position ids of :mod:`decoder_client.tree_attention`, takes the argmax
at every position, and accepts the longest root path whose every node equals the argmax at its
parent. The accepted tokens plus the argmax after the last of them (the bonus token) are
emitted, so a step always yields at least one token and greedy output equals plain greedy
decoding whatever the drafter proposes.

Sampling (``temperature > 0``) uses the same forward. The target distribution at a position is
``softmax(logits / temperature)``, top-k and top-p filtered as transformers does, and
:func:`sample_accept` walks the tree by recursive rejection of one-hot proposals (each child is
a deterministic guess), so the emitted tokens are distributed exactly as plain sampling from the
target, whatever the drafter proposes.

Logits processors (a repetition penalty, banned n-grams: transformers' ``LogitsProcessor``) run
before the choice, greedy or sampled, at every verified position on that position's own prefix
(the context, then the node's root path), as ``model.generate`` runs them on the prefix it has
when it reaches that position. A processor that is a function of the prefix and the scores
keeps the output equal to ``model.generate``'s with the same processors.

Numerics: "equals" holds in float32, where a verification forward's logits are those of
one-token decoding up to rounding. On SmolLM2-135M (logits up to 37) they differed by at most
9e-5, dense or with packed linears (:mod:`decoder_client.cpu_linears`), against a smallest
gap of 0.054 between a position's two likeliest tokens: no argmax moves. In bfloat16 they
differ by up to 0.9 and exact ties between the two likeliest occur, so greedy output can part
from ``model.generate``'s at such a position (2 of 16 SmolLM2 runs of 48 tokens did); nothing
here casts a model down, and :func:`decoder_client.models.load_model` loads float32.

KV cache pruning: after the forward, a ``DynamicCache`` holds ``past + root + n`` entries per
layer (``layers[i].keys`` / ``.values``, shape (batch, heads, seq, head_dim)). On every layer we
copy the accepted path's entries down, in place, to just after the root and crop the rest, so
only the tree's slice moves. A ``DynamicLayer`` derives its length from ``keys.shape[-2]``, so
the cache's bookkeeping stays consistent. Caches with other layer kinds (sliding windows, linear
attention) are refused, not approximated.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import LogitsProcessor

from decoder_client.tree_attention import check_parents, tree_attention_mask, tree_position_ids
from indexer.tokens import as_tokens
from indexer.tree_builder import DraftTree

Drafter = Callable[[np.ndarray], DraftTree]
# Picks (accepted node indices, bonus token) from a tree and its logits over [root, nodes...].
Chooser = Callable[[DraftTree, torch.Tensor], tuple[list[int], int]]

# Nodes one step verifies at most: a larger tree is cut to its first this many (wire order puts
# parents first, so the cut is a tree). The service's drafters never send more.
MAX_TREE = 1024


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` where it names it so
    (newer transformers, which deprecate the old name), else ``past_key_values``. Looked up once
    per model, not per forward."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class DecodeStats:
    """Per-step counts of one :meth:`ReferenceDecoder.generate` call.

    >>> s = DecodeStats(accepted=[2, 0], drafted=[4, 3], new_tokens=4, seconds=0.5)
    >>> s.steps, s.mat, s.tokens_per_s
    (2, 2.0, 8.0)
    """

    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per step
    drafted: list[int] = field(default_factory=list)  # draft tree size verified per step (within_depth)
    new_tokens: int = 0  # tokens returned (after eos / max_new_tokens truncation)
    seconds: float = 0.0  # wall time of the whole call, prefill included

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def mat(self) -> float:
        """Mean accepted tokens per step: accepted drafts plus the bonus token."""
        return float(np.mean(self.accepted)) + 1.0 if self.accepted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def greedy_accept(tokens: np.ndarray, parents: np.ndarray, argmax: np.ndarray) -> list[int]:
    """Node indices of the longest root path where each node equals the argmax at its parent.

    ``argmax`` covers the query block ``[root, nodes...]``, so node i's parent p is read at
    ``argmax[p + 1]``. Among siblings that both match, the first in wire order wins.

    >>> toks = np.array([5, 6, 7, 8], dtype=np.int32)
    >>> pars = np.array([-1, -1, 1, 1], dtype=np.int32)
    >>> greedy_accept(toks, pars, np.array([6, 0, 8, 0, 0]))  # root -> 6, node 1 -> 8
    [1, 3]
    """
    path: list[int] = []
    node = -1
    while True:
        hits = np.flatnonzero((parents == node) & (tokens == argmax[node + 1]))
        if hits.size == 0:
            return path
        node = int(hits[0])
        path.append(node)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Sampling distribution of each row of ``logits`` (..., V): ``softmax(logits / temperature)``.

    With ``top_k > 0`` it keeps, as transformers' ``TopKLogitsWarper`` does, the ``top_k`` most
    likely tokens (and any tied with the last of them); then with ``top_p < 1``, as its
    ``TopPLogitsWarper`` does, the smallest set of most likely tokens whose mass reaches ``top_p``
    (always at least the most likely one).

    >>> logits = torch.tensor([0.0, math.log(3.0)])  # probabilities 1/4, 3/4
    >>> target_probs(logits, temperature=0.5)  # squared and renormalised
    tensor([0.1000, 0.9000])
    >>> target_probs(logits, temperature=1.0, top_p=0.7)  # 3/4 alone reaches 0.7
    tensor([0., 1.])
    >>> target_probs(torch.tensor([0.0, 1.0, 2.0]), temperature=1.0, top_k=1)
    tensor([0., 0., 1.])
    """
    scores = logits.float()
    # Less the row's largest first: the same distribution, and no overflow to inf (then NaN) when
    # a small temperature would carry the logits past float32's range.
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return scores.softmax(dim=-1)


def sample_accept(
    tokens: np.ndarray, parents: np.ndarray, probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Speculative sampling over a deterministic draft tree: (accepted node indices, bonus token).

    ``probs`` (n+1, V) holds the target distribution after ``[root, nodes...]``. From the root,
    the children of the current node are tried in wire order: child x is accepted with
    probability ``p(x)``; if rejected, ``p`` becomes ``p`` without x, renormalised, and the next
    child is tried. When a child is accepted the walk continues from it with the distribution at
    its position; when none is, the bonus token is drawn from what is left of ``p``.

    Why it is lossless: with one child x, the token emitted is x with probability ``p(x)``, and
    any y != x with probability ``(1 - p(x)) * p(y) / (1 - p(x)) = p(y)``, so exactly ``p``.
    Trying the next child on the residual applies the same argument to ``p`` conditioned on
    not being x (sampling without replacement), and after an accepted node the next token is
    drawn from the target given that node's root path, so the whole emitted sequence follows the
    target's own distribution. A generator (CPU) makes the draws reproducible.

    >>> toks = np.array([5, 6], dtype=np.int32)  # node 0 = 5 under the root, node 1 = 6 under 0
    >>> pars = np.array([-1, 0], dtype=np.int32)
    >>> probs = torch.eye(8)[[5, 6, 2]]  # root -> 5, node 0 -> 6, node 1 -> 2, all certain
    >>> sample_accept(toks, pars, probs)
    ([0, 1], 2)
    """
    path: list[int] = []
    node = -1
    while True:
        residual = probs[node + 1].to(device="cpu", dtype=torch.float64, copy=True)
        children = np.flatnonzero(parents == node)
        hit = _first_accepted(tokens[children].tolist(), residual, generator)
        if hit is None:
            return path, int(torch.multinomial(residual, 1, generator=generator))
        node = int(children[hit])
        path.append(node)


def _first_accepted(candidates: list[int], residual: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """Index of the first candidate accepted by recursive rejection; rejected mass leaves ``residual``."""
    for i, token in enumerate(candidates):
        # Dividing by what is left renormalises; it is exactly 1 when x holds all of it (never rejected).
        chance = residual[token] / residual.sum()
        if torch.rand((), dtype=torch.float64, generator=generator) < chance:
            return i
        residual[token] = 0.0
    return None


def greedy_choice(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """The greedy :data:`Chooser`: :func:`greedy_accept`'s path and the argmax after it."""
    argmax = logits.argmax(dim=-1).cpu().numpy()
    path = greedy_accept(tree.tokens, tree.parents, argmax)
    return path, int(argmax[path[-1] + 1] if path else argmax[0])


def sampling_choice(
    temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None, top_k: int = 0
) -> Chooser:
    """The sampling :data:`Chooser`: :func:`sample_accept` on :func:`target_probs` of the logits."""

    def choose(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
        return sample_accept(tree.tokens, tree.parents, target_probs(logits, temperature, top_p, top_k), generator)

    return choose


def check_sampling(temperature: float, top_p: float, generator: torch.Generator | None, top_k: int = 0) -> None:
    """Raise ``ValueError`` unless ``temperature >= 0``, ``0 < top_p <= 1``, ``top_k`` is an int
    ``>= 0`` (0: no top-k) and the generator is on CPU."""
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"the generator must be a CPU one (draws happen on CPU), got {generator.device}")


def prune_cache(cache: DynamicCache, start: int, path: list[int]) -> None:
    """Keep positions ``[0, start)`` and ``start + path`` (ascending) in every layer, in place.

    The kept tail entries are copied down to ``start, start + 1, ...`` and the rest cropped, so
    only the tree's slice moves, never the whole past.

    >>> c = DynamicCache()
    >>> _ = c.update(torch.arange(5.0).view(1, 1, 5, 1), torch.zeros(1, 1, 5, 1), 0)
    >>> prune_cache(c, 2, [1, 2])  # keep 0, 1 (past and root) and tree slots 1, 2 (positions 3, 4)
    >>> c.layers[0].keys.flatten().tolist(), c.get_seq_length()
    ([0.0, 1.0, 3.0, 4.0], 4)
    """
    end = start + len(path)
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(f"cannot prune a {type(layer).__name__}; only full-attention layers")
        if not layer.is_initialized or layer.keys is None or layer.values is None:
            continue  # layers sharing another layer's cache hold nothing of their own
        src = torch.tensor(path, dtype=torch.long, device=layer.keys.device) + start
        if path != list(range(len(path))):  # a prefix of the tree is already in place
            layer.keys[..., start:end, :] = layer.keys.index_select(-2, src)
            layer.values[..., start:end, :] = layer.values.index_select(-2, src)
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]


@dataclass(frozen=True)
class VerifiedTopk:
    """The target's top-k at every position one step verified: the root (the context's last
    token) and each tree node, rejected ones included. A node's row is the target's own
    distribution after that token, whether or not it accepted the token: what the successor tier
    learns from (Token Recycling's adjacency is fed by every verified position).

    >>> v = VerifiedTopk(np.array([5, 7, 9], np.int32), np.array([[7, 1], [2, 3], [8, 4]], np.int32), np.array([0, 1]))
    >>> v.produced().tolist()  # the rows that produced the step's tokens: root's, then node 0's
    [[7, 1], [2, 3]]
    """

    after: np.ndarray  # int32 (n + 1,): the token at each verified position (root first, then the nodes)
    rows: np.ndarray  # int32 (n + 1, k): the target's likeliest next ids there
    path: np.ndarray  # int64: the positions whose rows produced the step's tokens (root, then each accepted node)

    def produced(self) -> np.ndarray:
        """Row i produced the step's i-th token (the bonus token's row last)."""
        return self.rows[self.path]


def processed(
    logits: torch.Tensor, context: np.ndarray, tree: DraftTree, processors: Sequence[LogitsProcessor]
) -> torch.Tensor:
    """``logits`` (n+1, V) over ``[root, nodes...]`` after ``processors``, each row given its own
    prefix: the context (whose last token is the root) for the root's row, the context and the
    node's root path for a node's.

    >>> class Ban(LogitsProcessor):  # the prefix's last token may not come next
    ...     def __call__(self, input_ids, scores):
    ...         return scores.scatter(-1, input_ids[:, -1:], -math.inf)
    >>> tree = DraftTree.chain(np.array([1], dtype=np.int32))
    >>> processed(torch.zeros(2, 3), np.array([2], dtype=np.int32), tree, [Ban()]).tolist()
    [[0.0, 0.0, -inf], [0.0, -inf, 0.0]]
    """
    prefixes = [context.tolist()]
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):
        prefixes.append([*prefixes[parent + 1], token])
    rows = []
    for prefix, row in zip(prefixes, logits, strict=True):
        ids = torch.tensor([prefix], dtype=torch.long, device=logits.device)
        scores = row[None].float()
        for processor in processors:
            scores = processor(ids, scores)
        rows.append(scores[0])
    return torch.stack(rows)


def first_nodes(tree: DraftTree, n: int) -> DraftTree:
    """``tree``'s first ``n`` nodes in wire order: a tree, since parents come first.

    >>> first_nodes(DraftTree.chain(np.array([5, 6, 7], dtype=np.int32)), 2).tokens.tolist()
    [5, 6]
    """
    if len(tree) <= n:
        return tree
    return DraftTree(tree.tokens[:n], tree.parents[:n], tree.sources[:n], tree.scores[:n])


def within_depth(tree: DraftTree, depth: int) -> DraftTree:
    """``tree`` without its nodes deeper than ``depth`` (parents renumbered).

    A step that may emit only ``depth + 1`` more tokens needs no deeper node: the node at depth
    ``depth + 1`` would give the step's last token, which the bonus after its parent gives as
    well (the same token greedily, the same distribution when sampling), and its position lies
    past any that plain decoding reaches (a model with learned positions may have none there).

    >>> t = DraftTree.chain(np.array([5, 6, 7], dtype=np.int32))
    >>> within_depth(t, 1).tokens.tolist(), within_depth(t, 0).tokens.tolist()
    ([5], [])
    """
    if len(tree) <= depth:  # a tree is never deeper than its size
        return tree
    keep = np.flatnonzero(tree.depths() <= depth)
    if keep.size == len(tree):
        return tree
    renumbered = np.full(len(tree), -1, dtype=np.int32)
    renumbered[keep] = np.arange(keep.size, dtype=np.int32)
    parents = tree.parents[keep]  # every kept node's parent is kept: it is shallower
    return DraftTree(
        tree.tokens[keep],
        np.where(parents >= 0, renumbered[np.maximum(parents, 0)], -1).astype(np.int32),
        tree.sources[keep],
        tree.scores[keep],
    )


def _finish(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> tuple[list[int], bool]:
    """Truncate like ``model.generate``: at ``max_new_tokens``, and just after the first eos."""
    out = tokens[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in out:
        return out[: out.index(eos_token_id) + 1], True
    return out, len(out) >= max_new_tokens


class ReferenceDecoder:
    """Greedy or sampling speculative decoding (batch 1) of a Hugging Face causal LM with draft trees.

    >>> dec = ReferenceDecoder(model, tokenizer)  # doctest: +SKIP
    >>> lookup = lambda ctx: DraftTree.chain(prompt_lookup(ctx, num_tokens=8))  # doctest: +SKIP
    >>> tokens, stats = dec.generate(prompt_ids, 32, drafter=lookup, eos_token_id=2)  # doctest: +SKIP
    >>> stats.mat  # doctest: +SKIP
    1.6
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: object | None = None, device: str = "cpu", max_tree: int = MAX_TREE
    ) -> None:
        if isinstance(max_tree, bool) or not isinstance(max_tree, int) or max_tree < 0:
            raise ValueError(f"max_tree must be an int >= 0, got {max_tree!r}")
        self.max_tree = max_tree  # nodes one step verifies at most (see MAX_TREE)
        self.device = torch.device(device)
        module: torch.nn.Module = model  # PreTrainedModel.to's wrapper confuses type checkers
        module.to(self.device)
        self.model = model.eval()
        self.tokenizer = tokenizer  # kept for callers that decode; generation works on ids
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self._cache_keyword = cache_keyword(model)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        drafter: Drafter | None = None,
        eos_token_id: int | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        topk: int = 0,
        top_k: int = 0,
        logits_processor: Sequence[LogitsProcessor] = (),
    ) -> tuple[list[int], DecodeStats]:
        """Continuation of ``prompt_ids``: greedy, or sampled when ``temperature > 0``.

        Greedy output is token-identical to ``model.generate(do_sample=False)``. Sampled output
        follows the distribution of plain sampling at ``temperature`` with ``top_k`` and ``top_p``
        (see :func:`sample_accept`); ``generator`` (CPU) seeds it. ``logits_processor`` (e.g.
        transformers' ``RepetitionPenaltyLogitsProcessor``) runs first at every verified position
        on its own prefix (:func:`processed`), greedy or sampled, as ``model.generate`` runs its
        ``logits_processor``. ``drafter`` maps the context so far
        (int32) to a :class:`DraftTree` (possibly empty); without one every step emits one token.
        Stops after ``eos_token_id`` or ``max_new_tokens`` tokens, whichever comes first; no step
        verifies a node deeper than the tokens still wanted (:func:`within_depth`), so no position
        past those plain decoding reaches is ever computed, nor more than ``max_tree`` nodes (a
        larger tree is cut to its first ``max_tree``, parents coming first in wire order).

        With ``topk`` > 0 and a drafter that has an ``observe_topk`` method, each step hands it
        the target's ``topk`` likeliest ids at every position it verified, the root and every
        tree node (:class:`VerifiedTopk`), before the next draft: the cache's successor tier
        learns from them, from the nodes verification rejected as well.
        """
        prompt_ids = as_tokens(prompt_ids, self.vocab_size, what="prompt_ids").tolist()
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_sampling(temperature, top_p, generator, top_k)
        choose = greedy_choice if temperature == 0 else sampling_choice(temperature, top_p, generator, top_k)
        processors = list(logits_processor)
        observe = getattr(drafter, "observe_topk", None) if topk > 0 else None
        began, stats = time.perf_counter(), DecodeStats()
        out: list[int] = []
        done = max_new_tokens == 0
        with torch.inference_mode():
            cache = self._prefill(prompt_ids[:-1])
            while not done:
                context = np.asarray([*prompt_ids, *out], dtype=np.int32)
                tree = drafter(context) if drafter is not None else DraftTree.empty()
                self._check_tree(tree)
                tree = within_depth(first_nodes(tree, self.max_tree), max_new_tokens - len(out) - 1)
                stats.drafted.append(len(tree))
                emitted, verified = self._step(cache, context, tree, choose, topk if observe else 0, processors)
                if observe is not None and verified is not None:
                    observe(verified)
                stats.accepted.append(len(emitted) - 1)
                out, done = _finish(out + emitted, max_new_tokens, eos_token_id)
        stats.new_tokens, stats.seconds = len(out), time.perf_counter() - began
        return out, stats

    def _prefill(self, ids: list[int]) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        if ids:
            tensor = torch.tensor([ids], dtype=torch.long, device=self.device)
            self.model(input_ids=tensor, **{self._cache_keyword: cache}, use_cache=True, logits_to_keep=1)
        return cache

    def _step(
        self,
        cache: DynamicCache,
        context: np.ndarray,
        tree: DraftTree,
        choose: Chooser,
        topk: int = 0,
        processors: Sequence[LogitsProcessor] = (),
    ) -> tuple[list[int], VerifiedTopk | None]:
        """One forward over ``[root] + tree`` (the root: the context's last token); returns the
        accepted tokens plus the bonus token, and with ``topk`` the ``topk`` likeliest ids at
        every position verified (after ``processors``: what the choice went by)."""
        root = int(context[-1])
        past = cache.get_seq_length()
        ids = torch.tensor([[root, *tree.tokens.tolist()]], dtype=torch.long, device=self.device)
        logits = self.model(
            input_ids=ids,
            attention_mask=tree_attention_mask(tree.parents, past, self.model.dtype, self.device),
            position_ids=tree_position_ids(tree.parents, past, self.device),
            **{self._cache_keyword: cache},
            use_cache=True,
        ).logits
        if processors:
            logits = processed(logits[0], context, tree, processors)[None]
        path, bonus = choose(tree, logits[0])
        prune_cache(cache, past + 1, path)
        verified = None
        if topk > 0:  # the root's logits produced the first token, node p's the one after p
            rows = logits[0].topk(min(topk, logits.shape[-1]), dim=-1).indices.to(torch.int32).cpu().numpy()
            after = np.concatenate(([root], tree.tokens)).astype(np.int32)
            verified = VerifiedTopk(after, rows, np.array([0, *(p + 1 for p in path)], dtype=np.int64))
        return [*tree.tokens[path].tolist(), bonus], verified

    def _check_tree(self, tree: DraftTree) -> None:
        check_parents(tree.parents)
        shapes = {a.shape for a in (tree.tokens, tree.parents, tree.sources, tree.scores)}
        if tree.tokens.dtype != np.int32 or len(shapes) > 1:
            raise ValueError(
                f"tree tokens must be int32 and each array of a tree shaped like its parents {tree.parents.shape};"
                f" got {tree.tokens.dtype} tokens and shapes {sorted(shapes)}"
            )
        if tree.tokens.size and (tree.tokens.min() < 0 or tree.tokens.max() >= self.vocab_size):
            raise ValueError(f"tree tokens must lie in [0, {self.vocab_size})")

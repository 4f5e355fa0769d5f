"""``draftcache generate``: one prompt through the reference speculative decoder, beside plain
greedy decoding and transformers' prompt lookup, with the tokens checked identical."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from decoder_client import cost_model
from decoder_client.chain_model import BesideCache
from decoder_client.client import ClientConfig, ClientSession, DraftClient, TopkAt
from decoder_client.cost_model import AcceptanceModel, CalibrationConfig, CostCurve
from decoder_client.draft_model import ModelDrafter
from decoder_client.reference_decoder import ReferenceDecoder, VerifiedTopk
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter, Session
from indexer.successors import MAX_TOPK
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree, Tier


@dataclass
class TierCounter:
    """Accepted draft tokens by the tier that proposed them (from each tree and what followed)."""

    counts: Counter[str] = field(default_factory=Counter)
    _last: DraftTree | None = None

    def observe(self, produced: np.ndarray, tree: DraftTree) -> None:
        if self._last is not None and produced.size:
            for node in self._last.accept(produced[:-1]):  # the last produced token is the bonus
                self.counts[Tier(int(self._last.sources[node])).name] += 1
        self._last = tree


class InProcessDrafter:
    """The engine in-process as a reference-decoder drafter (context in, tree out), for one
    request; pass ``engine`` to share one engine's memory between requests. The target's top-k
    feeds the successor tier at every node a step verified, or with ``every_node=False`` only
    where it produced the step's tokens (all a trace replay can feed). With ``lookahead`` > 0
    each tree is followed by trees drafted ahead for that many likely outcomes (pre-speculation,
    done while the target verifies), and a step whose outcome had one verifies it
    (``ahead_hits`` of ``ahead_steps``)."""

    def __init__(
        self,
        vocab_size: int,
        params: DraftParams,
        engine: NamespaceDrafter | None = None,
        *,
        every_node: bool = True,
        lookahead: int = 0,
    ) -> None:
        self._engine = engine or NamespaceDrafter(Namespace(name="local", vocab_size=vocab_size), DrafterConfig())
        self._params = params
        self._every_node = every_node
        self._lookahead = lookahead
        self._session: Session | None = None
        self._verified: VerifiedTopk | None = None
        self.tiers = TierCounter()
        self.ahead_hits = 0  # steps that verified a tree drafted ahead for their outcome
        self.ahead_steps = 0  # steps after one that drafted ahead

    def observe_topk(self, verified: VerifiedTopk) -> None:
        """The target's top-k where the last step verified (see ``ReferenceDecoder.generate``)."""
        self._verified = verified

    def __call__(self, context: np.ndarray) -> DraftTree:
        if self._session is None:
            self._session = self._engine.open(context)
            new = np.zeros(0, dtype=np.int32)
        else:
            new = context[len(self._session.context) :]
            v = self._verified
            if v is not None and self._every_node:  # every node's row, the rejected ones' too
                self._engine.observe_followers(v.after, v.rows)
            elif v is not None:
                self._engine.observe_topk(self._session, new, v.produced())
            self._engine.accept(self._session, new)
            self.ahead_steps += self._lookahead > 0
        self._verified = None
        tree = self._session.last_tree if self._lookahead and new.size else None
        if tree is not None:  # the outcome had been drafted ahead for: accept made it the tree
            self.ahead_hits += 1
        else:
            tree = self._engine.draft(self._session, self._params)
        if self._lookahead:
            self._engine.prespeculate(self._session, self._lookahead, self._params)
        self.tiers.observe(new, tree)
        return tree

    def close(self, *, commit: bool = True) -> None:
        """End the request; with ``commit`` its tokens join the engine's lifetime memory."""
        if self._session is not None:
            self._engine.close(self._session, commit=commit)
            self._session = None


class ServiceDrafter:
    """A running service (through :class:`DraftClient`) as a reference-decoder drafter."""

    def __init__(self, config: ClientConfig) -> None:
        self._client = DraftClient(config)
        self._session: ClientSession | None = None
        self._topk: VerifiedTopk | None = None
        self.tiers = TierCounter()

    def observe_topk(self, verified: VerifiedTopk) -> None:
        """The target's top-k where the last step verified, every node's: sent with the next
        call's tokens."""
        self._topk = verified

    def __call__(self, context: np.ndarray) -> DraftTree:
        rows = None
        if self._session is None:
            (self._session,) = self._client.open([context])
            new = np.zeros(0, dtype=np.int32)
        else:
            new = context[self._session.context.size :]
            if self._topk is not None:
                rows = [TopkAt(self._topk.after, self._topk.rows)]
        self._topk = None
        (tree,) = self._client.draft([self._session], [new.tolist()], rows)
        self.tiers.observe(new, tree)
        return tree

    def finish(self) -> None:
        if self._session is not None:
            self._client.close([self._session])
        self._client.shutdown()


def run_generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    drafter: Any,
    *,
    max_new_tokens: int,
    cost_aware: bool = True,
    draft_model: ModelDrafter | None = None,
) -> dict:
    """Vanilla greedy, transformers' prompt lookup and draftcache on the same prompt. With
    ``cost_aware`` the device's verification cost curve is measured first and every tree is cut
    to its most profitable prefix, valued by acceptance probabilities learned as decoding goes.
    With ``draft_model`` each step proposes its chain or the cache's, whichever is expected to
    give more tokens a second (:class:`decoder_client.chain_model.BesideCache`)."""
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = ids["input_ids"]
    verify = drafter
    verify_seconds = None
    if cost_aware:
        curve = CostCurve.measure(model, context=max(int(input_ids.shape[1]), 64))
        verify = cost_model.cost_aware(drafter, curve, AcceptanceModel(CalibrationConfig()))
        verify_seconds = curve.verify_seconds
    beside = BesideCache(verify, draft_model, verify_seconds) if draft_model is not None else None
    eos = tokenizer.eos_token_id
    results: dict[str, Any] = {}
    with torch.inference_mode():
        for name, kwargs in (("vanilla", {}), ("transformers-prompt-lookup", {"prompt_lookup_num_tokens": 10})):
            start = time.perf_counter()
            out = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
            tokens = out[0, input_ids.shape[1] :].tolist()
            results[name] = {"tokens_per_s": round(len(tokens) / (time.perf_counter() - start), 2), "tokens": tokens}
        decoder = ReferenceDecoder(model)
        tokens, stats = decoder.generate(
            input_ids[0].tolist(), max_new_tokens, drafter=beside or verify, eos_token_id=eos, topk=MAX_TOPK
        )
    results["draftcache"] = {
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "tokens": tokens,
        "mat": round(stats.mat, 3),
        "accepted_by_tier": dict(drafter.tiers.counts),
    }
    if beside is not None:  # whose drafts were verified, and accepted (all but the last step's)
        results["draftcache"]["model_steps"] = beside.model_steps
        results["draftcache"]["accepted_by_drafter"] = dict(beside.accepted)
    results["identical"] = all(
        r["tokens"] == results["vanilla"]["tokens"] for r in results.values() if isinstance(r, dict)
    )
    results["text"] = tokenizer.decode(tokens, skip_special_tokens=True)
    return results

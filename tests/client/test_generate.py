"""``draftcache generate``'s core on the real model: draftcache's output equals greedy decoding."""

from __future__ import annotations

import numpy as np

from benchmarks.generate import InProcessDrafter, run_generate
from decoder_client.reference_decoder import ReferenceDecoder
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.successors import MAX_TOPK
from indexer.tokens import Namespace

PROMPT = "Repeat exactly: alpha beta gamma delta. Then repeat it again: alpha beta gamma delta."


def test_generate_is_lossless_and_counts_tiers(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    drafter = InProcessDrafter(len(tokenizer), DraftParams(budget=16))
    # Whole trees verified: what is accepted does not hang on this machine's timings.
    result = run_generate(model, tokenizer, PROMPT, drafter, max_new_tokens=24, cost_aware=False)
    # Same tokens from vanilla greedy, transformers' prompt lookup and draftcache's tree decoder.
    assert result["identical"]
    ours = result["draftcache"]
    # The answer repeats the prompt's phrase: drafts from the request's own context are accepted.
    assert ours["mat"] > 1.0
    accepted = round(len(ours["tokens"]) - len(ours["tokens"]) / ours["mat"])  # tokens minus steps
    # Accepted draft tokens are attributed to tiers (all but the last step's, seen by no later call).
    assert 0 < sum(ours["accepted_by_tier"].values()) <= accepted


def test_generate_with_trees_cut_by_measured_cost_is_lossless(smollm2) -> None:  # type: ignore[no-untyped-def]
    # Cost-aware verification cuts each tree to the prefix worth verifying on this device (a
    # measured, machine-dependent curve): however much is cut, the output is greedy's.
    model, tokenizer = smollm2
    drafter = InProcessDrafter(len(tokenizer), DraftParams(budget=16))
    result = run_generate(model, tokenizer, PROMPT, drafter, max_new_tokens=24, cost_aware=True)
    assert result["identical"]
    assert result["draftcache"]["mat"] >= 1.0


def test_every_verified_node_feeds_the_successor_tier(smollm2) -> None:  # type: ignore[no-untyped-def]
    # The target's top-k at every tree node it verified, rejected ones included, reaches the
    # successor table; with every_node=False only the rows that produced the step's tokens do.
    model, tokenizer = smollm2
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True
    )
    ids = [int(i) for i in chat["input_ids"]]
    seen = {}
    for every_node in (True, False):
        engine = NamespaceDrafter(Namespace(name="t", vocab_size=len(tokenizer)), DrafterConfig())
        drafter = InProcessDrafter(len(tokenizer), DraftParams(budget=16), engine=engine, every_node=every_node)
        out, stats = ReferenceDecoder(model).generate(ids, 24, drafter=drafter, topk=MAX_TOPK)
        drafter(np.asarray([*ids, *out], dtype=np.int32))  # the last step's rows arrive with the next call
        seen[every_node] = (engine.successors.observations, stats)
    produced, path_stats = seen[False]
    assert produced == path_stats.new_tokens  # a row per token produced
    every, tree_stats = seen[True]
    assert every == sum(tree_stats.drafted) + tree_stats.steps  # a row per node, and the root's
    assert every > produced + sum(tree_stats.accepted)  # rejected nodes' rows too

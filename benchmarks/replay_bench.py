"""The replay benchmark: draftcache and its baselines over the same traces, side by side."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from benchmarks.baselines import (
    EngineDrafter,
    PromptLookupDrafter,
    RestDrafter,
    SuffixDecodingDrafter,
    rest_available,
    suffix_decoding_available,
)
from benchmarks.draft_model_replay import DraftModelChain, LiveDraftModel, LiveWithDraftModel, WithDraftModel
from benchmarks.draft_rows import SegmentRows
from benchmarks.replay import ReplayDrafter, ReplayStats, replay, takes_topk
from benchmarks.service_admin import ensure_namespace
from benchmarks.traces import Conversation, check_vocabulary
from cache_service.admin import warm
from cache_service.admin.warm import split_documents
from decoder_client.adapters import best_chain
from decoder_client.chain_model import ChainSource
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.prior import StaticPrior
from indexer.tokens import Namespace, as_tokens
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)

BASELINES = ("prompt-lookup", "suffix-decoding", "rest")
# SuffixDecoding's best max_spec_factor on our traces (min_token_prob 0.01), by the shape
# replayed. Trees: at 64 only the budget bounds a draft (Spec-Bench 2.142 against 2.060 at 8,
# swe_agent_dev 2.901 against 2.816). Chains: its own chain mode is the same at any factor from
# K up, and its tree cut to a chain is better at 8 (a smaller tree at a short match leaves the
# longer match to win: swe_agent_dev K=8 2.398 against 2.361 at 64).
SUFFIX_FACTOR = {"trees": 64.0, "chains": 8.0}


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    params: DraftParams = field(default_factory=DraftParams)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    baselines: tuple[str, ...] = ()
    # SuffixDecoding's max_spec_factor; None: its best on our traces for the shape replayed
    # (SUFFIX_FACTOR). Its vLLM default is factor 1.0, p 0.1.
    suffix_factor: float | None = None
    suffix_min_prob: float = 0.01
    # REST: a draftretriever datastore file (see build_rest_datastore); its tree holds at most
    # as many nodes as ours (params.budget; REST's default is 64 too).
    rest_datastore: Path | None = None
    include_engine: bool = True  # off when draftcache is replayed through a remote service
    lookahead: int = 0  # pre-speculation: stopping points drafted ahead for per step
    # Chain replay (what engines verify): every drafter proposes at most this many tokens in
    # one chain: ours in chain mode (params.chain), beside our tree cut to its best path;
    # prompt lookup drafting this many tokens; SuffixDecoding both in its own chain mode (as
    # vLLM runs it) and its tree cut to its best path; REST, which has no chain mode, its tree
    # cut. 0: trees.
    chain: int = 0
    # Hand the target's top-k at the verified positions to drafters that take them, where the
    # traces record it (off: measure the same traces without it).
    topk: bool = True

    @property
    def suffix_spec_factor(self) -> float:
        """SuffixDecoding's max_spec_factor in this replay: the one set, else its best for trees
        or chains (:data:`SUFFIX_FACTOR`)."""
        if self.suffix_factor is not None:
            return self.suffix_factor
        return SUFFIX_FACTOR["chains" if self.chain else "trees"]

    def __post_init__(self) -> None:
        unknown = set(self.baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; choose from {', '.join(BASELINES)}")
        if (self.suffix_factor is not None and self.suffix_factor <= 0) or not 0 <= self.suffix_min_prob < 1:
            raise ValueError("suffix_factor must be > 0 and suffix_min_prob in [0, 1)")
        if "rest" in self.baselines and self.rest_datastore is None:
            raise ValueError("the rest baseline needs a datastore (--rest-datastore)")
        if self.chain < 0 or self.chain != self.params.chain:
            raise ValueError(f"chain must be >= 0 and the params' chain, got {self.chain} and {self.params.chain}")


def by_namespace(
    conversations: list[Conversation], vocab_size: int | None = None
) -> list[tuple[Namespace, list[Conversation]]]:
    """The conversations of each namespace, namespaces in the order they first appear. Token ids
    mean nothing across namespaces, so each is replayed on drafters of its own. A namespace's
    vocabulary is ``vocab_size`` where given (it names one namespace's; every id, top-k lists
    included, must lie inside it), else its largest id + 1."""
    groups: dict[str, list[Conversation]] = {}
    for c in conversations:
        groups.setdefault(c.namespace, []).append(c)
    if vocab_size is not None and len(groups) > 1:
        raise ValueError(f"a vocabulary size names one namespace's; the traces hold {sorted(groups)}")
    if vocab_size is not None:
        check_vocabulary(conversations, vocab_size)
    return [
        (Namespace(name=name, vocab_size=vocab_size if vocab_size is not None else _largest_id(convs) + 1), convs)
        for name, convs in groups.items()
    ]


def namespace_of(conversations: list[Conversation], vocab_size: int | None) -> Namespace:
    """The one namespace ``conversations`` hold (a benchmark that drives one namespace)."""
    groups = by_namespace(conversations, None)
    if len(groups) != 1:
        raise ValueError(f"this covers one namespace; the traces hold {sorted(ns.name for ns, _ in groups)}")
    namespace = groups[0][0]
    return namespace if vocab_size is None else Namespace(name=namespace.name, vocab_size=vocab_size)


def _largest_id(conversations: list[Conversation]) -> int:
    return max([0, *(c.largest_id() for c in conversations)])


class BestChain:
    """A drafter's trees cut to their best path of at most ``k`` tokens by their own scores (from
    the root, always the highest-scoring child: :func:`~decoder_client.adapters.best_chain`),
    as an engine that verifies chains would take them.

    >>> BestChain(PromptLookupDrafter(), 4).name
    'prompt-lookup(n=1..3,k=10)/best_chain(4)'
    """

    def __init__(self, inner: ReplayDrafter, k: int) -> None:
        self.name = f"{inner.name}/best_chain({k})"
        self._inner = inner
        self._inner_takes_topk = takes_topk(inner)
        self._k = k

    def start(self, prompt: np.ndarray) -> None:
        self._inner.start(prompt)

    def propose(self) -> DraftTree:
        return DraftTree.chain(best_chain(self._inner.propose(), self._k))

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        if topk is not None and self._inner_takes_topk:
            self._inner.advance(tokens, topk=topk)
        else:
            self._inner.advance(tokens)

    def finish(self, commit_from: int) -> None:
        self._inner.finish(commit_from)


def warmed_engine(
    namespace: Namespace, config: DrafterConfig, prior: StaticPrior | None, documents: Sequence[np.ndarray] = ()
) -> NamespaceDrafter:
    """Our in-process engine, its lifetime memory holding ``documents`` (a corpus's, as
    ``draftcache warm --lifetime`` appends them to a service's log) indexed before any request.

    >>> docs = [np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32)]
    >>> warmed_engine(Namespace(name="t", vocab_size=10), DrafterConfig(), None, docs).memory.requests
    2
    """
    engine = NamespaceDrafter(namespace, config, prior=prior)
    for start in range(0, len(documents), _WARM_BATCH):
        engine.memory.commit_many([as_tokens(d, namespace.vocab_size) for d in documents[start : start + _WARM_BATCH]])
        if engine.memory.needs_rebuild():
            engine.memory.rebuild()
    if engine.memory.delta_tokens():  # the last documents, unless a rebuild just took them
        engine.memory.rebuild()
    return engine


_WARM_BATCH = 2048  # documents per delta run while warming


def drafters(
    namespace: Namespace,
    config: ReplayConfig,
    prior: StaticPrior | None,
    documents: Sequence[np.ndarray] = (),
    draft_rows: Sequence[SegmentRows] | None = None,
    chain_model: ChainSource | None = None,
) -> list[ReplayDrafter]:
    """The drafters to replay: ours in-process (in chain replay also our tree cut to its best
    path, as the adapters cut it), their lifetime memory warmed with ``documents``, and the
    baselines named, each proposing chains of at most ``config.chain`` tokens in chain replay
    (see :class:`ReplayConfig`). With ``draft_rows``
    (a draft model's rows for every request replayed, in order; chain replay only), also the
    draft model's greedy chains, and ours beside them; with ``chain_model``, the same from a
    draft model run at every step."""
    k = config.chain
    if (draft_rows is not None or chain_model is not None) and not (k and config.include_engine):
        raise ValueError("a draft model replays chains beside our in-process engine (chain > 0)")
    out: list[ReplayDrafter] = []
    if config.include_engine:
        engine = warmed_engine(namespace, config.drafter, prior, documents)
        out.append(EngineDrafter(engine, config.params, lookahead=config.lookahead))
        if k:
            tree_engine = warmed_engine(namespace, config.drafter, prior, documents)
            tree = EngineDrafter(tree_engine, replace(config.params, chain=0), name="draftcache-tree")
            out.append(BestChain(tree, k))
        if draft_rows is not None:
            out.append(DraftModelChain(draft_rows, k))
            mixed = EngineDrafter(warmed_engine(namespace, config.drafter, prior, documents), config.params)
            out.append(WithDraftModel(mixed, draft_rows, k))
        if chain_model is not None:
            out.append(LiveDraftModel(chain_model, k))
            mixed = EngineDrafter(warmed_engine(namespace, config.drafter, prior, documents), config.params)
            out.append(LiveWithDraftModel(mixed, chain_model))
    if "prompt-lookup" in config.baselines:
        out.append(PromptLookupDrafter(num_tokens=k) if k else PromptLookupDrafter())
    if "suffix-decoding" in config.baselines:
        if suffix_decoding_available():
            budget, factor, min_prob = config.params.budget, config.suffix_spec_factor, config.suffix_min_prob
            if k:  # its own chains, and its tree cut: which is better depends on the trace
                chains = SuffixDecodingDrafter(
                    max_spec_tokens=budget, max_spec_factor=factor, min_token_prob=min_prob, chain=k
                )
                out.append(chains)
            suffix = SuffixDecodingDrafter(max_spec_tokens=budget, max_spec_factor=factor, min_token_prob=min_prob)
            out.append(BestChain(suffix, k) if k else suffix)
        else:
            logger.warning("suffix-decoding baseline skipped: pip install arctic-inference==0.3.0")
    if "rest" in config.baselines and config.rest_datastore is not None:
        if rest_available():
            rest = RestDrafter(str(config.rest_datastore), choices=config.params.budget)
            out.append(BestChain(rest, k) if k else rest)
        else:
            logger.warning("rest baseline skipped: pip install draftretriever==0.1.1")
    return out


def build_rest_datastore(corpus: Path, fmt: str, tokenizer: Path, out: Path) -> int:
    """Write REST's datastore for a corpus to ``out``: every document (of a ShareGPT corpus,
    every turn, as REST's chat datastore holds) tokenized and added as one entry, then
    suffix-sorted by ``draftretriever``. Returns the tokens written. The file appears whole or
    not at all."""
    import draftretriever

    encode, vocab = warm.load_tokenizer(tokenizer)
    docs = split_documents(warm.tokenize_corpus(warm.read_corpus(corpus, fmt, every_turn=True), encode, vocab))
    total = sum(doc.size for doc in docs)
    if total == 0:
        raise warm.CorpusError(f"{corpus}: the corpus holds no documents")
    tmp = out.with_name(out.name + ".tmp")
    writer = draftretriever.Writer(str(tmp), vocab_size=vocab)
    try:
        for doc in docs:
            writer.add_entry(doc.tolist())
        writer.finalize()
    except BaseException:
        del writer  # it writes its file when dropped: drop it before removing that file
        tmp.unlink(missing_ok=True)
        raise
    del writer
    os.replace(tmp, out)
    return total


def remote_drafter(target: str, namespace: Namespace, params: DraftParams, lookahead: int = 0) -> ReplayDrafter:
    """draftcache through a running service (drafting ahead for ``lookahead`` outcomes a step);
    the namespace is created there if missing."""
    from benchmarks.remote import RemoteDrafter

    ensure_namespace(target, namespace)
    return RemoteDrafter(target, namespace.name, params, lookahead=lookahead)


def run_replay(
    conversations: list[Conversation],
    drafter_list: list[ReplayDrafter],
    *,
    topk: bool = True,
    progress_every_s: float = 60.0,
) -> list[ReplayStats]:
    """Each drafter's replay of ``conversations``, one after the other. A replay that runs longer
    than ``progress_every_s`` logs how far it has come at most that often (a draft model's replay
    can take an hour)."""
    results = []
    for d in drafter_list:
        start = time.perf_counter()
        progress = _Progress(d.name, len(conversations), start, progress_every_s)
        stats = replay(conversations, d, topk=topk, after_conversation=progress)
        logger.info("%s: MAT %.3f in %.1f s", d.name, stats.mat, time.perf_counter() - start)
        results.append(stats)
    return results


class _Progress:
    """Logs a replay's conversations done and its MAT so far, at most once every ``every_s``."""

    def __init__(self, name: str, total: int, start: float, every_s: float) -> None:
        self.name, self.total, self.start, self.every_s = name, total, start, every_s
        self.last = start

    def __call__(self, done: int, stats: ReplayStats) -> None:
        now = time.perf_counter()
        if done == self.total or now - self.last < self.every_s:
            return
        self.last = now
        elapsed = now - self.start
        line = "%s: %d of %d conversations, MAT so far %.3f, %.0f s"
        logger.info(line, self.name, done, self.total, stats.mat, elapsed)


def per_step_time(mat: float, drafted_per_step: float, step_cost: float) -> float:
    """Tokens per unit of verification time where a step costs 1 plus ``step_cost`` per token
    it checks: plain decoding is 1.0, and a drafter that proposes much for little falls below.

    >>> per_step_time(2.0, 5.0, 0.1), per_step_time(2.0, 0.0, 0.1)
    (1.3333333333333333, 2.0)
    """
    return mat / (1.0 + step_cost * drafted_per_step)


def report(
    results: list[ReplayStats],
    trace: Path,
    *,
    as_json: bool,
    by_namespace: list[tuple[str, list[ReplayStats]]] | None = None,
    step_cost: float = 0.0,
) -> str:
    """The side-by-side table; with ``by_namespace`` (traces of several namespaces, ``results``
    their merge) each namespace's MAT per drafter too. With ``step_cost`` (a proposed token's
    cost as a share of a verification step), each drafter's tokens per step-time too
    (:func:`per_step_time`): what an engine that pays for every proposed token gains."""
    rows = [r.summary() for r in results]
    if step_cost:
        for res, r in zip(results, rows, strict=True):
            r["step_cost"] = step_cost
            r["tokens_per_step_time"] = round(per_step_time(res.mat, res.drafted / max(res.steps, 1), step_cost), 4)
    if as_json:
        out: dict = {"trace": str(trace), "results": rows}
        if by_namespace is not None:
            out["by_namespace"] = {name: [r.summary() for r in part] for name, part in by_namespace}
        return json.dumps(out, indent=2)
    cats = sorted({c for r in rows for c in r["mat_by_category"]})
    width = max(len(r["drafter"]) for r in rows) + 2
    lines = [f"trace: {trace}"]
    costed = f"{'per cost':>10}" if step_cost else ""
    head = f"{'drafter':<{width}}{'MAT':>7}{'draft/step':>11}{costed}{'p50 us':>9}{'p99 us':>9}"
    lines.append(head)
    for r in rows:
        cost = f"{r['tokens_per_step_time']:>10.3f}" if step_cost else ""
        lines.append(
            f"{r['drafter']:<{width}}{r['mat']:>7.3f}{r['drafted_per_step']:>11.1f}{cost}"
            f"{r['draft_us_p50']:>9.0f}{r['draft_us_p99']:>9.0f}"
        )
    if step_cost:
        lines.append(f"per cost: tokens per step-time, a proposed token costing {step_cost:g} of a step")
    fed = [f"{r['drafter']} {r['topk_rows']}" for r in rows if "topk_rows" in r]
    if fed:
        lines.append("the target's top-k handed over, verified positions: " + ", ".join(fed))
    for r in rows:
        if "prespeculation_hit_rate" in r:
            lines.append(
                f"{r['drafter']}: drafted ahead for {r['prespeculation_hit_rate']:.1%} of steps "
                f"(drafting ahead p50 {r['draft_ahead_us_p50']:.0f} us, p99 {r['draft_ahead_us_p99']:.0f} us): "
                f"the stopping point drafted for on {r['prespeculation_point_rate']:.1%} of steps, "
                f"the bonus token among the candidates drafted there on {r['prespeculation_bonus_rate']:.1%} of those"
            )
    if by_namespace is not None:
        lines.append("")
        lines.append("MAT by namespace: " + " | ".join(r["drafter"] for r in rows))
        for name, part in by_namespace:
            lines.append(f"  {name:<16}" + "  ".join(f"{r.mat:.3f}" for r in part))
    lines.append("")
    lines.append("MAT by category: " + " | ".join(r["drafter"] for r in rows))
    for c in cats:
        vals = "  ".join(f"{r['mat_by_category'].get(c, 0):.3f}" for r in rows)
        lines.append(f"  {c:<16}{vals}")
    tiers = rows[0]["accepted_by_tier"]
    if tiers:
        total = sum(tiers.values())
        lines.append(
            "accepted draft tokens by tier (draftcache): " + ", ".join(f"{t} {v / total:.1%}" for t, v in tiers.items())
        )
    return "\n".join(lines)

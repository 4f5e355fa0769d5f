"""Drafting for one namespace: every tier queried, scored, merged into one tree.

Each tier turns a match into rows of continuations with prefix probabilities (how often each
prefix followed the match). A tier's probabilities are scaled by its confidence: a prior that
grows with the match length, times a calibration factor learned online from which tier's first
guess the target actually accepted, per tier and match length. So a tier earns its place in the
tree by its track record on this namespace, not by a hand-set weight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from indexer import kernels
from indexer.calibration import Calibrator
from indexer.chain import ChainCalibrator
from indexer.kernels import accept as accept_kernel
from indexer.kernels import draft as draft_kernel
from indexer.kernels.draft import JOB_COLUMNS
from indexer.kernels.draft import SETTINGS as _SETTINGS
from indexer.kernels.draft_chain import draft_chain_batch
from indexer.lifetime_index import LifetimeConfig, LifetimeMemory, SearchArrays, prompt_key
from indexer.prespeculation import Prefetched, chain_stopping_points, fans, likeliest_outcomes, select
from indexer.prior import StaticPrior
from indexer.session import HeldChain, Session, SessionSnapshot
from indexer.session_cache import LruTableConfig
from indexer.session_store import SessionStore
from indexer.successors import SuccessorTable, checked_topk
from indexer.tokens import SEPARATOR, Namespace, as_tokens
from indexer.tree_builder import DraftedTrees, DraftTree, Tier, TreeBatch

logger = logging.getLogger(__name__)

_TIER_NAMES = [t.name for t in Tier]  # by value: counting by name without building enums
MAX_BUDGET = 1024
MAX_DEPTH = 128
MAX_LOOKAHEAD = 16  # outcomes drafted ahead per step
# Chains drafted ahead per stopping point of a chain, on average: a session drafting ahead for k
# points drafts chains for its AHEAD_CHAINS * k likeliest outcomes (point and bonus token).
AHEAD_CHAINS = 4
TREE_RANKS = ("calibrated", "score")  # how a tree's nodes may be ranked (DrafterConfig.tree_rank)
MIN_SKIP = 256  # a known leading part shorter than this is committed again (not worth a cut)
_BRANCHES = 4  # rejected branches remembered where verification left a tree
# Fewest sequences a worker thread of the threaded draft step takes: waking the threads costs
# about as much as drafting two or three (compiled step over batch-32 calls of a loaded server,
# 2 threads: 4 sequences 1.0-1.6x one thread's time, 6 sequences 0.75-0.85x, 32 0.7x).
MIN_PER_THREAD = 3


def step_threads(threads: int, sequences: int) -> int:
    """Worker threads a draft step over ``sequences`` takes of the ``threads`` configured: no
    more than gives each :data:`MIN_PER_THREAD` (1: the calling thread alone)."""
    return max(1, min(threads, sequences // MIN_PER_THREAD))


Branches = Sequence[tuple[int, np.ndarray]]  # rejected branches: (accepted tokens before it, its tokens)


_CALIBRATED_AFTER = 2000  # node outcomes the chain calibrator learns from before trees and pre-speculation rank by it


@dataclass(frozen=True, kw_only=True)
class DraftParams:
    """Per-request drafting knobs (they travel with each draft call)."""

    budget: int = 64  # most nodes in a tree
    max_depth: int = 32  # most tokens on one path
    min_score: float = 0.0  # drop nodes estimated less likely than this
    depth_reserve: int = 8  # nodes kept for the best chain before widening
    # Chain mode (what engines verify): > 0 cuts the tree (of ``budget`` nodes, ``chain``
    # levels) to its path of at most ``chain`` tokens with the largest expected accepted length
    # (see :mod:`indexer.chain`); 0 drafts the tree itself.
    chain: int = 0
    chain_min_prob: float = 0.0  # a chain ends before a token less likely than this to be reached

    def __post_init__(self) -> None:
        if not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {self.budget}")
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth}")
        if not 0.0 <= self.min_score < 1.0:
            raise ValueError(f"min_score must be in [0, 1), got {self.min_score}")
        if not 0 <= self.depth_reserve <= MAX_DEPTH:
            raise ValueError(f"depth_reserve must be in [0, {MAX_DEPTH}], got {self.depth_reserve}")
        if not 0 <= self.chain <= MAX_DEPTH:
            raise ValueError(f"chain must be in [0, {MAX_DEPTH}], got {self.chain}")
        if not 0.0 <= self.chain_min_prob < 1.0:
            raise ValueError(f"chain_min_prob must be in [0, 1), got {self.chain_min_prob}")


# Prior confidence n / (n + half[tier]): the match length at which a tier is right half the time.
_HALF = {
    Tier.CONTEXT: 2.0,
    Tier.DYNAMIC: 3.0,
    Tier.LIFETIME_SA: 4.0,
    Tier.LIFETIME_NGRAM: 4.0,
    Tier.PRIOR: 5.0,
    Tier.REJECTED: 30.0,
    Tier.EXACT: 0.25,
    Tier.SUCCESSOR: 1.0,  # a one-token leader: confidence 1 / (1 + half) before calibration
}


def _offset(offset: int, accepted: int) -> int:
    if not 0 <= offset < accepted:
        raise ValueError(f"rejected branch offset must be in [0, {accepted}), got {offset}")
    return offset


_TIERS = list(Tier)  # by value (Tier iterates in value order)
_HALF_ARRAY = np.array([_HALF[t] for t in Tier], dtype=np.float64)


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def warm_draft_step(lifetime: SearchArrays, threads: int = 1) -> None:
    """Compile (or load) the batch draft step for these lifetime arrays before a request needs
    it: memory-mapped indexes are read-only, a type of their own to the compiler."""
    store = SessionStore()
    jobs = np.zeros((0, len(JOB_COLUMNS)), dtype=np.int64)
    counts = np.zeros((len(_TIERS), 2))
    settings = np.zeros(len(_SETTINGS), dtype=np.int64)
    none = np.zeros(0, dtype=np.int32)
    calibrator = ChainCalibrator()
    args = (jobs, np.zeros(0), none, none, *kernels.no_prior(), store.i32, store.i64, *_lifetime_args(lifetime),
            *SuccessorTable(0).kernel_args(), settings, _HALF_ARRAY, counts, counts,
            *calibrator.cell_args())  # fmt: skip
    for n in {1, threads}:
        kernels.draft_step(n)(*args)
    none64 = np.zeros(0, dtype=np.int64)
    chain_args = (*args, none64, np.zeros(0), none64, *calibrator.reach_args())
    draft_chain_batch(*chain_args)


def _lifetime_args(a: SearchArrays) -> tuple:
    return (
        a.main_tokens, a.main_sa, a.run_tokens, a.run_sa, a.run_offsets,
        a.table_keys, a.table_offsets, a.table_followers, a.table_probs, a.table_leader_len, a.main_serial,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DynamicConfig:
    """The session's dynamic tier: what followed the context's last ``leader_len`` tokens
    earlier in the request, the ``max_followers`` most recent distinct continuations weighted by
    how often each occurred (Cacheback's leader -> follower table, read off the context)."""

    leader_len: int = 2
    follower_len: int = 8
    max_followers: int = 4
    window: int = 2048  # prompt tokens it draws from (every generated token counts)

    def __post_init__(self) -> None:
        for name in ("leader_len", "follower_len", "max_followers", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    max_match: int = 32  # longest suffix match looked for
    samples: int = 32  # continuations sampled from one lifetime match
    context_samples: int = 16  # ... from one match in the request's own context
    dynamic: DynamicConfig = field(default_factory=DynamicConfig)
    rejected: LruTableConfig = field(default_factory=lambda: LruTableConfig(max_leaders=1024, max_followers=2))
    lifetime: LifetimeConfig = field(default_factory=LifetimeConfig)
    calibration_buckets: int = 16
    # Worker threads a batch's draft step shares its sequences among (1: the calling thread
    # alone), each taking at least MIN_PER_THREAD. The trees are the same either way; more
    # threads shorten a large batch's step.
    threads: int = 1
    # How a tree-mode draft ranks its nodes: "calibrated", by the chance verification reaches
    # each (the chain calibrator's, see indexer.kernels.tree.merge_tree) once the calibrator
    # has learnt from _CALIBRATED_AFTER node outcomes; "score", by the merged tiers' scores.
    tree_rank: str = "calibrated"

    def __post_init__(self) -> None:
        for name in ("max_match", "samples", "context_samples", "calibration_buckets", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tree_rank not in TREE_RANKS:
            raise ValueError(f"tree_rank must be one of {TREE_RANKS}, got {self.tree_rank!r}")


@dataclass
class DraftCounters:
    """What a namespace's drafts earned, for monitoring (monotonic counts)."""

    steps: int = 0  # verification outcomes seen (accepted tokens reported after a tree)
    drafted: int = 0  # tree nodes proposed
    # accepted draft tokens by tier (every tier present, so readers never see the dict grow)
    accepted: dict[str, int] = field(default_factory=lambda: {t.name: 0 for t in Tier})
    ahead_hits: int = 0  # outcomes a tree had been drafted ahead for
    ahead_misses: int = 0  # outcomes of a pre-speculated step that nothing was drafted for


class Ended(NamedTuple):
    """A request ended with commit: the tokens the lifetime memory takes of it (less a start it
    holds already), its prompt and its response."""

    tokens: np.ndarray
    prompt: np.ndarray
    response: np.ndarray


class NamespaceDrafter:
    """All drafting state of one namespace.

    >>> d = NamespaceDrafter(Namespace(name="t", vocab_size=100), DrafterConfig())
    >>> s = d.open([5, 6, 7, 8, 5, 6])
    >>> d.draft(s, DraftParams(budget=4)).tokens.tolist()[:2]  # "5 6" was followed by "7 8"
    [7, 8]
    """

    def __init__(
        self, namespace: Namespace, config: DrafterConfig, prior: StaticPrior | None = None, *, own_ring: bool = True
    ) -> None:
        self.namespace = namespace
        self.config = config
        self.memory = LifetimeMemory(config.lifetime, ring=own_ring)  # own_ring=False: indexes adopted
        self.prior = prior
        self.calibrator = Calibrator(config.calibration_buckets)
        self.chain_calibrator = ChainCalibrator()  # node acceptance: chains cut and trees kept by it
        self._calibrated = False  # it has learnt enough to keep trees by (see _calibrated_enough)
        self.successors = SuccessorTable(namespace.vocab_size)  # the target's own top-k, fed back
        self.counters = DraftCounters()
        self._lock = threading.Lock()
        dyn = config.dynamic
        values = {"max_match": config.max_match, "samples": config.samples, "context_samples": config.context_samples,
                  "leader_len": dyn.leader_len, "follower_len": dyn.follower_len, "max_followers": dyn.max_followers,
                  "buckets": config.calibration_buckets, "stop": int(SEPARATOR), "window": dyn.window}  # fmt: skip
        self._settings = np.array([values[name] for name in _SETTINGS], dtype=np.int64)
        self.store = SessionStore()  # the arrays of the sessions drafted for, by row
        kernels.warm_up()  # compile or load the compiled loops now, not on the first draft
        self.threads = 1
        if config.threads > 1:
            if kernels.warm_up_threads():
                self.threads = config.threads
            else:
                logger.warning("the compiled code's threading layer is not thread-safe: drafting on one thread")

    def open(self, prompt: np.ndarray | list[int]) -> Session:
        return self.open_checked(as_tokens(prompt, self.namespace.vocab_size, what="prompt"))

    def open_checked(self, tokens: np.ndarray) -> Session:
        """:meth:`open` for a prompt already checked against the namespace (as :meth:`accept_checked`
        takes tokens): a contiguous int32 array with every id in the vocabulary."""
        return Session(tokens, self.config.rejected, self.memory.exact_response(prompt_key(tokens)))

    def resume(self, snapshot: SessionSnapshot) -> Session:
        """A session continued from :meth:`Session.snapshot` (taken here or on another replica)."""
        context = as_tokens(snapshot.context, self.namespace.vocab_size, what="context")
        if not 0 <= snapshot.prompt_len <= context.size:
            raise ValueError(f"prompt_len {snapshot.prompt_len} outside a context of {context.size} tokens")
        prompt = context[: snapshot.prompt_len]
        return Session.restore(snapshot, self.config.rejected, self.memory.exact_response(prompt_key(prompt)))

    def draft(self, session: Session, params: DraftParams) -> DraftTree:
        """The draft tree for the session's current context."""
        return self.draft_many([(session, params)])[0]

    def draft_many(self, items: Sequence[tuple[Session, DraftParams]]) -> DraftedTrees:
        """:meth:`draft` for several sessions (each named once) in one compiled call; each
        session keeps its tree, and each tier's first guess for calibration, until the outcome
        is known."""
        sessions = [session for session, _ in items]
        for session in sessions:
            if session.prefetched:
                session.prefetched, session.ahead_chains = {}, {}
        rows = np.array([self.store.hold(s) for s in sessions], dtype=np.int64)
        # A path never holds more nodes than the tree, nor a chain's tree than the chain.
        table, min_score = _jobs(rows, [p for _, p in items], _tree_depth, True)
        chains = [p.chain for _, p in items]
        if all(chains) and step_threads(self.threads, len(table)) == 1:  # the usual chain-mode call
            return self._chain_step(items, table, min_score)
        for session, params in items:
            if not params.chain:  # a tree's outcome teaches the chances its nodes are kept by
                session.calibrates = True
        self._rank(table, items)
        trees = self._step(sessions, table, min_score, _NO_TOKENS, _NO_TOKENS)
        if not any(chains):
            return trees
        return self._chains(trees, items)

    def _rank(self, table: np.ndarray, items: Sequence[tuple[Session, DraftParams]]) -> None:
        """Where trees are ranked by their calibrated chances, each tree-mode job's session
        track record in ``table``'s track column (else -1 there: ranked by score)."""
        if self.config.tree_rank != "calibrated" or not self._calibrated_enough():
            return
        tracks = [-1 if p.chain else s.track for s, p in items]
        table[:, draft_kernel.TRACK] = tracks

    def _calibrated_enough(self) -> bool:
        """Whether the chain calibrator has learnt enough to rank trees by its chances (its
        counts only grow, so once it has, it stays so)."""
        if not self._calibrated:
            self._calibrated = self.chain_calibrator.trials >= _CALIBRATED_AFTER
        return self._calibrated

    def _chain_step(
        self, items: Sequence[tuple[Session, DraftParams]], table: np.ndarray, min_score: np.ndarray
    ) -> DraftedTrees:
        """Every job's chain, its tree drafted and cut in one compiled call
        (:func:`~indexer.kernels.draft_chain.draft_chain_batch`), as :meth:`_chains` cuts the
        trees :meth:`_step` drafts (the same chains). The calibration is read without the lock:
        its counts are updated in place, so a draft beside an outcome's update reads each count
        before or after it."""
        sessions = [session for session, _ in items]
        args = (
            *self._step_args(table, min_score, _NO_TOKENS, _NO_TOKENS), *_chain_jobs(items),
            *self.chain_calibrator.reach_args(),
        )  # fmt: skip
        tokens, parents, sources, scores, ends, claims, grown = draft_chain_batch(*args)
        self._follow_grown(sessions, grown)
        drafted = DraftedTrees(TreeBatch(tokens, parents, sources, scores, ends))
        _keep_chains(sessions, drafted, claims)
        return drafted

    def _chains(self, trees: DraftedTrees, items: Sequence[tuple[Session, DraftParams]]) -> DraftedTrees:
        """Each chain-mode job's tree cut to its chain (see :mod:`indexer.chain`), the others
        as drafted. The session keeps the whole tree: its outcome teaches the calibrator which
        nodes the target accepts, and its rejected branches are remembered as a tree's are."""
        sessions = [session for session, _ in items]
        if all(p.chain for _, p in items):  # every tree cut (a threaded step's batch), in one compiled pass
            with self._lock:
                batch, claims = self.chain_calibrator.chains(trees.batch, *_chain_jobs(items))
            drafted = DraftedTrees(batch)
            _keep_chains(sessions, drafted, claims)
            return drafted
        out = []
        for tree, (session, params) in zip(trees, items, strict=True):
            if params.chain:
                with self._lock:
                    tree, claims = self.chain_calibrator.chain(tree, params.chain, params.chain_min_prob, session.track)
                session.calibrates = True
                session.chain = HeldChain(tree.tokens, claims, session.track, [tree], 0)
            out.append(tree)
        return DraftedTrees(_batch_of(out))

    def release(self, session: Session) -> None:
        """The session is done with here (closed, or leaving memory): its row in the store goes."""
        self.store.release(session)

    def accept(
        self,
        session: Session,
        tokens: np.ndarray | list[int],
        rejected: Sequence[tuple[int, np.ndarray | list[int]]] | None = None,
    ) -> None:
        """Tokens the target produced since the last draft (accepted drafts plus the bonus token).

        ``rejected`` lists ``(offset, branch)``: a branch the target rejected where it left the
        accepted tokens after ``offset`` of them. By default the branches come from the session's
        last tree, where verification stopped. Each is remembered in the rejected table.
        """
        vocab = self.namespace.vocab_size
        new = as_tokens(tokens, vocab, what="accepted tokens")
        checked = None
        if rejected is not None:
            checked = [(_offset(off, new.size), as_tokens(b, vocab, what="rejected branch")) for off, b in rejected]
        self.accept_checked(session, new, checked)

    def accept_checked(self, session: Session, new: np.ndarray, rejected: Branches | None = None) -> None:
        """:meth:`accept` for tokens (and branches, their offsets in range) already checked
        against the namespace: a contiguous int32 array with every id in the vocabulary."""
        self.accept_many([(session, new, rejected)])

    def accept_many(self, items: Sequence[tuple[Session, np.ndarray, Branches | None]]) -> None:
        """:meth:`accept_checked` for several sessions, each named once, in one compiled call
        (:func:`~indexer.kernels.accept.accept_batch`): where verification left each last tree,
        the calibration of every first guess, the contexts extended and the branches rejected
        where verification stopped (the best ones leaving the accepted path there, each
        extended by its best-scoring descendants) recorded, unless the item names its own."""
        items = [item for item in items if item[1].size]
        if not items:
            return
        table, new_at = [], 0
        for session, new, rejected in items:
            branches = _BRANCHES if rejected is None else 0  # branches the item names are recorded here
            table.append((self.store.hold(session), new_at, new_at + new.size, branches))
            new_at += new.size
        jobs = np.array(table, dtype=np.int64).reshape(-1, len(accept_kernel.ITEM_COLUMNS))
        produced = _joined([new for _, new, _ in items], np.int32)
        self._learn_chains(items, jobs, produced)
        # A tree drafted ahead for this outcome is what the decoder verifies next.
        ahead = [(s, new, select(s.prefetched, new)) for s, new, _ in items if s.prefetched]
        c = self.counters
        for s, _, tree in ahead:
            if s.has_tree:
                c.ahead_hits += tree is not None
                c.ahead_misses += tree is None
        by_tier = np.zeros(len(_TIERS), dtype=np.int64)
        with self._lock:
            steps, drafted, grown = accept_kernel.accept_batch(
                jobs,
                produced,
                self.store.i32,
                self.store.i64,
                *self.calibrator.arrays(),
                self.config.calibration_buckets,
                by_tier,
            )
        c.steps += steps
        c.drafted += drafted
        for tier, n in enumerate(by_tier.tolist()):
            if n:
                c.accepted[_TIER_NAMES[tier]] += n
        self._follow_grown([session for session, _, _ in items], grown)
        for session, new, rejected in items:
            if rejected:  # each branch is keyed by the context tail where it branched off
                before = len(session.context) - new.size
                session.rejected.record_at(session.context.tokens, [(before + at, b) for at, b in rejected])
        for session, new, tree in ahead:
            session.last_tree, session.prefetched = tree, {}
            if session.ahead_chains:  # a chain drafted ahead for this outcome is the next chain
                claims = session.ahead_chains.get(tuple(new.tolist()))
                if tree is not None and claims is not None:
                    session.chain = HeldChain(tree.tokens, claims, session.track, [tree], 0)
                    session.calibrates = True
                session.ahead_chains = {}

    def observe_topk(self, session: Session, new: np.ndarray, topk: np.ndarray | list[list[int]]) -> None:
        """The target's top-k at the positions the decoder verified for ``new`` (the tokens the
        step produced, not yet accepted): row i was the distribution that produced ``new[i]``,
        so it follows the token before it (the context's last one for row 0). Feeds the
        namespace's successor table. ``-1`` pads a short row.

        >>> d = NamespaceDrafter(Namespace(name="t", vocab_size=100), DrafterConfig())
        >>> s = d.open([5, 6, 7])
        >>> d.observe_topk(s, np.array([8, 9], np.int32), [[8, 3], [9, -1]])
        >>> d.successors.followers_of(7), d.successors.followers_of(8)
        ([8, 3], [9])
        >>> d.observe_topk(s, np.array([8], np.int32), [[100]])
        Traceback (most recent call last):
        ...
        ValueError: top-k id 100 outside the vocabulary of 100
        """
        rows = checked_topk(topk, new.size, self.namespace.vocab_size)
        if not new.size or not len(session.context):
            return
        prev = np.empty(new.size, dtype=np.int32)
        prev[0] = session.context.tokens[-1]
        prev[1:] = new[:-1]
        self.successors.observe(prev, rows)

    def observe_followers(self, after: np.ndarray | list[int], topk: np.ndarray | list[list[int]]) -> None:
        """The target's top-k after each token of ``after``: row i was the distribution at a
        position holding ``after[i]``. A decoder that verified a tree holds such a row at every
        node, the ones verification rejected included (Token Recycling's adjacency learns from
        all of them), where :meth:`observe_topk` takes the rows of the tokens a step produced.

        >>> d = NamespaceDrafter(Namespace(name="t", vocab_size=100), DrafterConfig())
        >>> d.observe_followers([7, 40], [[8, 3], [41, 9]])  # 40: a node the target rejected
        >>> d.successors.followers_of(40)
        [41, 9]
        >>> d.observe_followers([7], [[8], [9]])
        Traceback (most recent call last):
        ...
        ValueError: top-k must be 1 rows of 1 to 8 ids, got shape (2, 1)
        """
        tokens = as_tokens(after, self.namespace.vocab_size, what="top-k positions")
        self.successors.observe(tokens, checked_topk(topk, tokens.size, self.namespace.vocab_size))

    def _learn_chains(
        self, items: Sequence[tuple[Session, np.ndarray, Branches | None]], jobs: np.ndarray, produced: np.ndarray
    ) -> None:
        """The chain calibrator learns from the outcome of each tree its probabilities rank (a
        tree-mode draft's, a chain-mode draft's whole tree, a pre-speculating session's tree):
        the accept step's ``jobs`` table and ``produced`` tokens, every outcome in one compiled
        pass."""
        tracks = np.array([s.track if s.calibrates else -1 for s, _, _ in items], dtype=np.int64)
        if tracks.max() >= 0:
            ends = np.empty(len(items) + 1, dtype=np.int64)
            ends[0], ends[1:] = 0, jobs[:, accept_kernel.NEW_END]
            rows = np.ascontiguousarray(jobs[:, accept_kernel.ROW])  # the compiled pass's one layout
            with self._lock:
                after = self.chain_calibrator.update_rows(self.store.i32, self.store.i64, rows, produced, ends, tracks)
            for (session, new, _), track in zip(items, after, strict=True):
                if track < 0:
                    continue
                session.calibrates = False
                if session.has_tree:
                    session.track = track
                if session.chain is not None:
                    held = session.chain
                    with self._lock:
                        self.chain_calibrator.update_reach(held.tokens, held.claims, new, held.track)
        for session, _, _ in items:
            session.chain = None

    def prespeculate(self, session: Session, k: int, params: DraftParams) -> Prefetched:
        """Trees drafted ahead for the ``k`` likeliest outcomes of verifying the session's last
        draft (see :mod:`indexer.prespeculation`); the next :meth:`accept` goes on with the one
        the outcome selects. For a chain-mode draft the outcomes are its chain's, and what is
        drafted ahead for each is a fan of chains, one per bonus token. Session state is left as
        it was, apart from remembering them."""
        return self.prespeculate_many([(session, k, params)])[0]

    def prespeculate_many(self, items: Sequence[tuple[Session, int, DraftParams]]) -> list[Prefetched]:
        """:meth:`prespeculate` for several sessions ``(session, k, params)``, each named once:
        the stopping points of all their drafts found, and every tree drafted ahead for them, in
        one compiled call each (chain-mode drafts' in their own)."""
        for _, k, _ in items:
            if not 0 <= k <= MAX_LOOKAHEAD:
                raise ValueError(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {k}")
        for session, _, _ in items:
            session.ahead_chains = {}
        chained = [bool(p.chain) and s.chain is not None and s.has_tree for s, _, p in items]
        out: list[Prefetched] = [{} for _ in items]
        for wanted, ahead in ((False, self._trees_ahead), (True, self._chains_ahead)):
            js = [j for j, c in enumerate(chained) if c == wanted]
            if js:
                for j, prefetched in zip(js, ahead([items[j] for j in js]), strict=True):
                    out[j] = prefetched
        for (session, _, _), prefetched in zip(items, out, strict=True):
            session.prefetched = prefetched
        return out

    def forgo_ahead(self, sessions: Sequence[Session]) -> None:
        """Nothing drafted ahead for these sessions' last drafts (none kept from before)."""
        for session in sessions:
            session.prefetched, session.ahead_chains = {}, {}

    def _trees_ahead(self, items: Sequence[tuple[Session, int, DraftParams]]) -> list[Prefetched]:
        """Tree-mode drafts' outcomes: one tree per stopping point of each session's last tree."""
        rows = np.array([self.store.hold(s) for s, _, _ in items], dtype=np.int64)
        ks = np.array([k for _, k, _ in items], dtype=np.int64)
        reach, reach_at = self._reach([s for s, _, _ in items])
        owner, path_tokens, path_ends, kid_tokens, kid_ends = kernels.stopping_points_rows(
            self.store.i32, self.store.i64, rows, ks, reach, reach_at
        )
        # One tree per stopping point, its context extended by the point's path and its root
        # leaving out that node's children; one level deeper: the bonus token becomes the root.
        # The outcomes are only supposed: nothing learnt about them stays (remember off).
        per_item, min_score = _jobs(
            rows, [p for _, _, p in items], lambda p: min(p.max_depth + 1, MAX_DEPTH, max(p.budget, 1)), False
        )
        table = _extended(per_item[owner], path_ends, kid_ends)
        sessions = [items[j][0] for j in owner.tolist()]
        drafted = self._step(sessions, table, min_score[owner], path_tokens, kid_tokens) if owner.size else ()
        out: list[Prefetched] = [{} for _ in items]
        paths, start = path_tokens.tolist(), 0
        for i, (j, end) in enumerate(zip(owner.tolist(), path_ends.tolist(), strict=True)):
            out[j][tuple(paths[start:end])] = drafted[i]
            start = end
        return out

    def _chains_ahead(self, items: Sequence[tuple[Session, int, DraftParams]]) -> list[Prefetched]:
        """Chain-mode drafts' outcomes: at each of the ``k`` likeliest stopping points of each
        session's chain (by each token's calibrated chance of being reached), the candidates
        for the bonus token (a one-level tree there, leaving out the one token the chain has
        after the point); then, for the session's :data:`AHEAD_CHAINS` ``* k`` likeliest
        outcomes among them, the chain the next step would draft after each, all in one
        compiled call. A point's candidates and their chains make one fan
        (:func:`~indexer.prespeculation.fans`)."""
        owner: list[int] = []
        paths: list[np.ndarray] = []
        kids: list[np.ndarray] = []
        chances: list[float] = []
        for j, (session, k, _) in enumerate(items):
            held = session.chain
            assert held is not None
            tokens = held.tokens
            with self._lock:
                reach = self.chain_calibrator.reach(held.claims, held.track)
            lengths, stops = chain_stopping_points(reach, k)
            for n, chance in zip(lengths.tolist(), stops.tolist(), strict=True):
                owner.append(j)
                paths.append(np.asarray(tokens[:n], dtype=np.int32))
                kids.append(np.asarray(tokens[n : n + 1], dtype=np.int32))
                chances.append(chance)
        if not owner:
            return [{} for _ in items]
        rows = np.array([self.store.hold(s) for s, _, _ in items], dtype=np.int64)
        params = [p for _, _, p in items]
        points = np.array(owner, dtype=np.int64)
        path_ends, path_tokens = _ends(paths), _joined(paths, np.int32)
        # Each point's candidates for the bonus token; nothing learnt stays (remember off).
        per_item, min_score = _jobs(rows, params, lambda p: 1, False)
        table = _extended(per_item[points], path_ends, _ends(kids))
        sessions = [items[j][0] for j in owner]
        firsts = self._step(sessions, table, min_score[points], path_tokens, _joined(kids, np.int32)).batch
        keep = np.array([AHEAD_CHAINS * k for _, k, _ in items], dtype=np.int64)
        outcomes = likeliest_outcomes(points, np.array(chances), keep, path_tokens, path_ends, firsts)
        kept = outcomes.kept
        bonus = TreeBatch(
            firsts.tokens[kept], firsts.parents[kept], firsts.sources[kept], firsts.scores[kept],
            np.concatenate(([0], outcomes.kept_ends)),
        )  # fmt: skip
        # A chain after each outcome kept, its context extended by the point's path and the candidate.
        job_of = np.repeat(points, np.diff(bonus.offsets))
        per_item, min_score = _jobs(rows, params, _tree_depth, False)
        table = _extended(per_item[job_of], outcomes.suffix_ends, np.zeros(kept.size, dtype=np.int64))
        jobs = [(items[j][0], items[j][2]) for j in job_of.tolist()]
        args = (
            *self._step_args(table, min_score[job_of], outcomes.suffix_tokens, _NO_TOKENS), *_chain_jobs(jobs),
            *self.chain_calibrator.reach_args(),
        )  # fmt: skip
        tokens, parents, sources, scores, ends, claims, grown = draft_chain_batch(*args)
        self._follow_grown([s for s, _ in jobs], grown)
        trees = DraftedTrees(fans(bonus, TreeBatch(tokens, parents, sources, scores, ends)))
        out: list[Prefetched] = [{} for _ in items]
        bonus_tokens, chain_ends, first = bonus.tokens.tolist(), ends.tolist(), 0
        for i, (j, last) in enumerate(zip(owner, outcomes.kept_ends.tolist(), strict=True)):
            key = tuple(paths[i].tolist())
            out[j][key] = trees[i]
            ahead = items[j][0].ahead_chains
            for r in range(first, last):  # each candidate's chain's raw claims
                ahead[(*key, bonus_tokens[r])] = claims[chain_ends[r] : chain_ends[r + 1]]
            first = last
        return out

    def _reach(self, sessions: Sequence[Session]) -> tuple[np.ndarray, np.ndarray]:
        """Per node of each session's last tree, the calibrated probability that verification
        accepts it (:class:`~indexer.chain.ChainCalibrator`), end to end, and where each
        session's start (-1: no tree). Tree scores are not probabilities (they sum the tiers'
        votes, capped at 1): ranked by them, the true stopping point was among the 4 likeliest
        on 41% of the SmolLM2 trace's steps, by these on 65%. Each such session's outcome
        teaches the calibrator in turn; until it has learnt from :data:`_CALIBRATED_AFTER`
        outcomes, the scores rank the points (its guesses before any outcome rank worse)."""
        parts, at, n = [], np.full(len(sessions), -1, dtype=np.int64), 0
        for session in sessions:
            session.calibrates = True
        if not self._calibrated_enough():  # its first guesses rank worse than the scores
            return np.zeros(0, dtype=np.float32), at
        for j, session in enumerate(sessions):
            tree = session.last_tree
            if tree is None or not len(tree):
                continue
            with self._lock:
                conditional = self.chain_calibrator.conditional(tree, session.track)
            parts.append(kernels.chain_reach(tree.parents, conditional).astype(np.float32))
            at[j], n = n, n + len(tree)
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)), at

    def close(self, session: Session, *, commit: bool = True, commit_from: int = 0) -> np.ndarray | None:
        """Finish a request; with ``commit`` its tokens from ``commit_from`` join the lifetime
        buffer and its prompt -> output pair the exact-prompt cache. A long leading part the
        memory already holds (the earlier turns a multi-turn request repeats) is not added
        again, past an overlap of ``max_match`` tokens that keeps the junction searchable.
        Returns the tokens added. Without ``commit`` the session is released all the same."""
        if not commit:
            self.release(session)
            return None
        return self.close_many([(session, commit_from)])[0]

    def close_many(self, closing: Sequence[tuple[Session, int]]) -> list[np.ndarray]:
        """:meth:`close` with commit for several requests ``(session, commit_from)`` at once,
        indexed together (one run of the lifetime memory's delta, not one each)."""
        ended = self.end_many(closing)
        self.remember(ended)
        return [e.tokens for e in ended]

    def end_many(self, closing: Sequence[tuple[Session, int]]) -> list[Ended]:
        """The first half of :meth:`close_many`: the sessions released, and what each request
        would add to the lifetime memory, which takes nothing yet (a caller that must first
        learn whether storage held a request already hands the others to :meth:`remember`)."""
        ended = []
        for session, commit_from in closing:
            self.release(session)  # a no-op where the caller released it already
            tokens = session.context.tokens
            if not 0 <= commit_from <= tokens.size:
                raise ValueError(f"commit_from must be in [0, {tokens.size}], got {commit_from}")
            added = tokens[max(commit_from, self._known(tokens)) :].copy()
            ended.append(Ended(added, tokens[: session.prompt_len], session.generated))
        return ended

    def remember(self, ended: Sequence[Ended]) -> None:
        """The second half of :meth:`close_many`: ended requests join the lifetime memory
        together, each with its ``prompt -> response`` for exact hits."""
        self.memory.commit_many([e.tokens for e in ended], exact=[(e.prompt, e.response) for e in ended])

    def commit_finished(self, requests: Sequence[np.ndarray]) -> None:
        """Finished requests no session here drafted for (another process's, read from the
        service's lifetime log) join the lifetime memory, less what it holds at their start."""
        self.memory.commit_many([tokens[self._known(tokens) :].copy() for tokens in requests])

    def _known(self, tokens: np.ndarray) -> int:
        """Where ``tokens`` start to be new to the lifetime memory: a long prefix it holds
        already (a prompt seen before) is not added again, all but its last ``max_match``."""
        known = self.memory.known_prefix(tokens) - self.config.max_match
        return known if known >= MIN_SKIP else 0

    # -- tiers -------------------------------------------------------------------------------

    def _step(
        self,
        sessions: Sequence[Session],
        table: np.ndarray,
        min_score: np.ndarray,
        suffix: np.ndarray,
        exclude: np.ndarray,
    ) -> DraftedTrees:
        """Each job's tree, all drafted in one compiled call (see
        :func:`~indexer.kernels.draft.draft_batch`) over the sessions' arrays in the store: row
        ``j`` of the jobs table (see :func:`_jobs`) drafts for ``sessions[j]``; only the static
        prior is looked up here first."""
        step = kernels.draft_step(step_threads(self.threads, len(table)))
        args = self._step_args(table, min_score, suffix, exclude)
        tokens, parents, sources, scores, ends, grown = step(*args)
        self._follow_grown(sessions, grown)
        return DraftedTrees(TreeBatch(tokens, parents, sources, scores, ends))

    def _step_args(self, table: np.ndarray, min_score: np.ndarray, suffix: np.ndarray, exclude: np.ndarray) -> tuple:
        """The draft step's arguments for these jobs: the sessions' store, every tier's arrays."""
        prior = self.prior.kernel_args if self.prior is not None else kernels.no_prior()
        return (
            table, min_score, suffix, exclude, *prior, self.store.i32, self.store.i64,
            *_lifetime_args(self.memory.search_arrays()), *self.successors.kernel_args(), self._settings, _HALF_ARRAY,
            *self.calibrator.arrays(), *self.chain_calibrator.cell_args(),
        )  # fmt: skip

    def _follow_grown(self, sessions: Sequence[Session], grown: np.ndarray) -> None:
        """The store takes up each session whose tree buffer the step had to grow."""
        for j, size in enumerate(grown.tolist()):  # a list's walk: cheaper than flatnonzero at batch 1
            if size:
                self.store.follow(sessions[j], size)


def _extended(table: np.ndarray, suffix_ends: np.ndarray, exclude_ends: np.ndarray) -> np.ndarray:
    """Jobs ``table`` (written in place and returned), row ``i`` drafting after its context
    extended by the suffix tokens ending at ``suffix_ends[i]`` and leaving those ending at
    ``exclude_ends[i]`` out of its root (each laid end to end, row after row)."""
    table[:, draft_kernel.SUFFIX_START] = np.concatenate(([0], suffix_ends[:-1]))
    table[:, draft_kernel.SUFFIX_END] = suffix_ends
    table[:, draft_kernel.EXCLUDE_START] = np.concatenate(([0], exclude_ends[:-1]))
    table[:, draft_kernel.EXCLUDE_END] = exclude_ends
    return table


def _ends(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Where each of ``parts`` ends, laid end to end."""
    return np.cumsum([len(x) for x in parts], dtype=np.int64)


def _chain_jobs(items: Sequence[tuple[Session, DraftParams]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per chain-mode job, its chain's most tokens, its stopping chance and its session's track
    record, as the compiled cut takes them."""
    ks = np.array([p.chain for _, p in items], dtype=np.int64)
    min_probs = np.array([p.chain_min_prob for _, p in items], dtype=np.float64)
    return ks, min_probs, np.array([s.track for s, _ in items], dtype=np.int64)


def _keep_chains(sessions: Sequence[Session], drafted: DraftedTrees, claims: np.ndarray) -> None:
    """Each session keeps its chain (tree ``j`` of ``drafted``, its raw ``claims`` laid out as
    the chains are) and track record until the outcome teaches the chain calibrator."""
    at = drafted.batch.offsets.tolist()
    tokens = drafted.batch.tokens
    for j, session in enumerate(sessions):
        session.calibrates = True
        session.chain = HeldChain(tokens[at[j] : at[j + 1]], claims[at[j] : at[j + 1]], session.track, drafted, j)


def _tree_depth(p: DraftParams) -> int:
    """Levels of the tree drafted for ``p``: a path never holds more nodes than the tree, nor a
    chain's tree more levels than the chain (its budget goes to alternatives within reach)."""
    depth = min(p.max_depth, max(p.budget, 1))
    return min(depth, p.chain) if p.chain else depth


def _batch_of(trees: Sequence[DraftTree]) -> TreeBatch:
    """Trees joined end to end into one batch."""
    ends = np.cumsum([0] + [len(t) for t in trees], dtype=np.int64)
    return TreeBatch(
        _joined([t.tokens for t in trees], np.int32),
        _joined([t.parents for t in trees], np.int32),
        _joined([t.sources for t in trees], np.uint8),
        _joined([t.scores for t in trees], np.float32),
        ends,
    )


def _jobs(
    rows: np.ndarray, params: Sequence[DraftParams], depth: Callable[[DraftParams], int], remember: bool
) -> tuple[np.ndarray, np.ndarray]:
    """A jobs table for the draft step, a job per store row ``rows[j]`` drafting with
    ``params[j]`` to ``depth(params[j])`` levels (no suffix, nothing left out), and each job's
    least score. With ``remember`` each session keeps its tree and first guesses, its
    match-length hints and how far its output agrees with an exact-prompt response."""
    first = params[0] if params else None
    if first is None or all(p is first for p in params):  # the usual batch: one request's settings
        # One row written as a list and copied per job: at batch 1, filling the table a column
        # at a time took 4 us of a 60 us draft.
        job = [0] * len(JOB_COLUMNS)
        job[draft_kernel.TRACK] = -1  # ranked by score
        job[draft_kernel.REMEMBER] = int(remember)
        if first is not None:
            job[draft_kernel.DEPTH], job[draft_kernel.BUDGET] = depth(first), first.budget
            job[draft_kernel.DEPTH_RESERVE] = first.depth_reserve
        written = []
        for row in rows.tolist():
            job[draft_kernel.ROW] = row
            written.append(job.copy())
        min_score = float(first.min_score) if first is not None else 0.0  # a float: float64, as compiled
        return np.array(written, dtype=np.int64).reshape(rows.size, len(JOB_COLUMNS)), np.array([min_score] * rows.size)
    table = np.zeros((rows.size, len(JOB_COLUMNS)), dtype=np.int64)
    table[:, draft_kernel.ROW] = rows
    table[:, draft_kernel.TRACK] = -1  # ranked by score
    table[:, draft_kernel.REMEMBER] = int(remember)
    table[:, draft_kernel.DEPTH] = [depth(p) for p in params]
    table[:, draft_kernel.BUDGET] = [p.budget for p in params]
    table[:, draft_kernel.DEPTH_RESERVE] = [p.depth_reserve for p in params]
    return table, np.array([p.min_score for p in params], dtype=np.float64)


_NO_TOKENS = np.zeros(0, dtype=np.int32)

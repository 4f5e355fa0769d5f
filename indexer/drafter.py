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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from indexer import kernels
from indexer.calibration import Calibrator
from indexer.kernels.draft import SEQ_COLUMNS
from indexer.kernels.draft import SETTINGS as _SETTINGS
from indexer.lifetime_index import LifetimeConfig, LifetimeMemory, SearchArrays, prompt_key
from indexer.prespeculation import Prefetched, select, stopping_points
from indexer.prior import StaticPrior
from indexer.session import Guesses, Session, SessionSnapshot
from indexer.session_cache import LruTableConfig
from indexer.tokens import SEPARATOR, Namespace, as_tokens
from indexer.tree_builder import DraftTree, Tier, TreeBatch

logger = logging.getLogger(__name__)

_TIER_NAMES = [t.name for t in Tier]  # by value: counting by name without building enums
MAX_BUDGET = 1024
MAX_DEPTH = 128
MAX_LOOKAHEAD = 16  # outcomes drafted ahead per step
MIN_SKIP = 256  # a known leading part shorter than this is committed again (not worth a cut)
_REJECTED_BRANCHES = 4  # branches remembered where verification left a tree

Branches = Sequence[tuple[int, np.ndarray]]  # rejected branches: (accepted tokens before it, its tokens)


@dataclass(frozen=True, kw_only=True)
class DraftParams:
    """Per-request drafting knobs (they travel with each draft call)."""

    budget: int = 64  # most nodes in a tree
    max_depth: int = 32  # most tokens on one path
    min_score: float = 0.0  # drop nodes estimated less likely than this
    depth_reserve: int = 8  # nodes kept for the best chain before widening

    def __post_init__(self) -> None:
        if not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {self.budget}")
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth}")
        if not 0.0 <= self.min_score < 1.0:
            raise ValueError(f"min_score must be in [0, 1), got {self.min_score}")
        if not 0 <= self.depth_reserve <= MAX_DEPTH:
            raise ValueError(f"depth_reserve must be in [0, {MAX_DEPTH}], got {self.depth_reserve}")


# Prior confidence n / (n + half[tier]): the match length at which a tier is right half the time.
_HALF = {
    Tier.CONTEXT: 2.0,
    Tier.DYNAMIC: 3.0,
    Tier.LIFETIME_SA: 4.0,
    Tier.LIFETIME_NGRAM: 4.0,
    Tier.PRIOR: 5.0,
    Tier.REJECTED: 30.0,
    Tier.EXACT: 0.25,
}


def _offset(offset: int, accepted: int) -> int:
    if not 0 <= offset < accepted:
        raise ValueError(f"rejected branch offset must be in [0, {accepted}), got {offset}")
    return offset


_TIERS = list(Tier)  # by value (Tier iterates in value order)
_HALF_ARRAY = np.array([_HALF[t] for t in Tier], dtype=np.float64)
_ONE_WEIGHT = np.ones(1)  # the exact tier's single row


class _Job(NamedTuple):
    """One tree to draft: the session, the context it is drafted after (the session's own, or
    extended by a supposed verification outcome), root tokens to leave out, and limits."""

    session: Session
    context: np.ndarray
    exclude: tuple[int, ...]
    params: DraftParams
    depth: int


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _stored(trees: list[DraftTree]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Trees as :func:`~indexer.kernels.tree.verification_outcomes` reads them: ``(tokens,
    parents, scores, sources, starts, ends)``. Trees of one draft batch (a decoder's usual
    step) are read where the batch holds them; others are joined."""
    batch = trees[0].batch if trees else None
    if batch is not None and all(t.batch is batch for t in trees):
        rows = np.array([t.row for t in trees], dtype=np.int64)
        return batch.tokens, batch.parents, batch.scores, batch.sources, batch.offsets[rows], batch.offsets[rows + 1]
    sizes = np.array([len(t) for t in trees], dtype=np.int64)
    ends = np.cumsum(sizes)
    return (
        _joined([t.tokens for t in trees], np.int32),
        _joined([t.parents for t in trees], np.int32),
        _joined([t.scores for t in trees], np.float32),
        _joined([t.sources for t in trees], np.uint8),
        ends - sizes,
        ends,
    )


def warm_draft_step(lifetime: SearchArrays, threads: int = 1) -> None:
    """Compile (or load) the batch draft step for these lifetime arrays before a request needs
    it: memory-mapped indexes are read-only, a type of their own to the compiler."""
    empty = _Batch().arrays()
    counts = np.zeros((len(_TIERS), 2))
    for n in {1, threads}:
        _draft_batch(empty, lifetime, np.zeros(len(_SETTINGS), dtype=np.int64), counts, counts, n)


def _draft_batch(
    batch: tuple[np.ndarray, ...],
    lifetime: SearchArrays,
    settings: np.ndarray,
    hits: np.ndarray,
    pred: np.ndarray,
    threads: int = 1,
) -> tuple[np.ndarray, ...]:
    """:func:`~indexer.kernels.draft.draft_batch` over packed jobs (:meth:`_Batch.arrays`),
    on ``threads`` worker threads (a lone sequence is drafted on the calling thread; an empty
    batch, as warming up sends, runs the step asked for)."""
    seq, min_score, contexts, index_tokens, index_sa, exclude, part_rows, part_vals, part_meta, part_offsets = batch
    a = lifetime
    step = kernels.draft_step(1 if seq.shape[0] == 1 else threads)
    return step(
        seq, min_score, contexts, index_tokens, index_sa, exclude, part_rows, part_vals, part_meta, part_offsets,
        a.main_tokens, a.main_sa, a.run_tokens, a.run_sa, a.run_offsets,
        a.table_keys, a.table_offsets, a.table_followers, a.table_probs, a.table_leader_len,
        settings, _HALF_ARRAY, hits, pred,
    )  # fmt: skip


class _Batch:
    """Jobs laid out end to end for :func:`~indexer.kernels.draft.draft_batch`: one row of
    integers per sequence, its context, its prompt index (once per session), the root tokens
    it leaves out, and the tiers' parts found before the call."""

    def __init__(self) -> None:
        self.seq: list[tuple[int, ...]] = []
        self.min_score: list[float] = []
        self.contexts: list[np.ndarray] = []
        self.index_tokens: list[np.ndarray] = []
        self.index_sa: list[np.ndarray] = []
        self.index_of: dict[int, tuple[int, int]] = {}  # by session identity
        self.exclude: list[int] = []
        self.rows: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.meta: list[tuple[int, int, int, int, int]] = []
        self.first_part: list[int] = []  # per sequence, where its parts start in ``meta``
        self._context_at = self._index_at = 0

    def add_sequence(self, job: _Job, *, since: int) -> None:
        """A job; the parts added next belong to it."""
        s, ctx = job.session, job.context
        index = self.index_of.get(id(s))
        if index is None:
            sa_tokens, sa = s.context.prompt_index
            index = self.index_of[id(s)] = (self._index_at, self._index_at + sa.size)
            self.index_tokens.append(sa_tokens)
            self.index_sa.append(sa)
            self._index_at += sa.size
        x = len(self.exclude)
        at = self._context_at
        self.seq.append(
            (at, at + ctx.size, *index, s.context.indexed, since, *s.hints, job.depth, job.params.budget,
             job.params.depth_reserve, x, x + len(job.exclude))
        )  # fmt: skip
        self.contexts.append(ctx)
        self._context_at += ctx.size
        self.exclude.extend(job.exclude)
        self.min_score.append(job.params.min_score)
        self.first_part.append(len(self.meta))

    def add_part(self, rows: np.ndarray, values: np.ndarray, *, per_cell: bool, tier: Tier, n: int) -> None:
        """The last sequence's ``rows`` of a tier found at match length ``n``, with per-row
        weights or (``per_cell``) per-cell probabilities."""
        k, width = rows.shape
        self.rows.append(rows.ravel())
        self.vals.append(values.ravel())
        self.meta.append((k, width, int(per_cell), int(tier), n))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (
            np.array(self.seq, dtype=np.int64).reshape(-1, len(SEQ_COLUMNS)),
            np.array(self.min_score, dtype=np.float64),
            _joined(self.contexts, np.int32),
            _joined(self.index_tokens, np.int32),
            _joined(self.index_sa, np.int32),
            np.array(self.exclude, dtype=np.int32),
            _joined(self.rows, np.int32),
            _joined(self.vals, np.float64),
            np.array(self.meta, dtype=np.int64).reshape(-1, 5),
            np.array([*self.first_part, len(self.meta)], dtype=np.int64),
        )


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
    # alone). The trees are the same either way; more threads shorten a large batch's step.
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("max_match", "samples", "context_samples", "calibration_buckets", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class DraftCounters:
    """What a namespace's drafts earned, for monitoring (monotonic counts)."""

    steps: int = 0  # verification outcomes seen (accepted tokens reported after a tree)
    drafted: int = 0  # tree nodes proposed
    # accepted draft tokens by tier (every tier present, so readers never see the dict grow)
    accepted: dict[str, int] = field(default_factory=lambda: {t.name: 0 for t in Tier})
    ahead_hits: int = 0  # outcomes a tree had been drafted ahead for
    ahead_misses: int = 0  # outcomes of a pre-speculated step that nothing was drafted for


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
        self.counters = DraftCounters()
        self._lock = threading.Lock()
        dyn = config.dynamic
        values = {"max_match": config.max_match, "samples": config.samples, "context_samples": config.context_samples,
                  "leader_len": dyn.leader_len, "follower_len": dyn.follower_len, "max_followers": dyn.max_followers,
                  "buckets": config.calibration_buckets, "stop": int(SEPARATOR)}  # fmt: skip
        self._settings = np.array([values[name] for name in _SETTINGS], dtype=np.int64)
        kernels.warm_up()  # compile or load the compiled loops now, not on the first draft
        self.threads = 1
        if config.threads > 1:
            if kernels.warm_up_threads():
                self.threads = config.threads
            else:
                logger.warning("the compiled code's threading layer is not thread-safe: drafting on one thread")

    def open(self, prompt: np.ndarray | list[int]) -> Session:
        tokens = as_tokens(prompt, self.namespace.vocab_size, what="prompt")
        return Session(tokens, self.config, self.memory.exact_response(prompt_key(tokens)))

    def resume(self, snapshot: SessionSnapshot) -> Session:
        """A session continued from :meth:`Session.snapshot` (taken here or on another replica)."""
        context = as_tokens(snapshot.context, self.namespace.vocab_size, what="context")
        if not 0 <= snapshot.prompt_len <= context.size:
            raise ValueError(f"prompt_len {snapshot.prompt_len} outside a context of {context.size} tokens")
        prompt = context[: snapshot.prompt_len]
        return Session.restore(snapshot, self.config, self.memory.exact_response(prompt_key(prompt)))

    def draft(self, session: Session, params: DraftParams) -> DraftTree:
        """The draft tree for the session's current context."""
        return self.draft_many([(session, params)])[0]

    def draft_many(self, items: Sequence[tuple[Session, DraftParams]]) -> list[DraftTree]:
        """:meth:`draft` for several sessions (each named once) in one compiled call; each
        session remembers its tree, and each tier's first guess for calibration once the
        outcome is known."""
        jobs = []
        for session, params in items:
            depth = min(params.max_depth, max(params.budget, 1))  # a path never holds more nodes than the tree
            jobs.append(_Job(session, session.context.tokens, (), params, depth))
        trees = []
        for (session, _), (tree, guesses, hints) in zip(items, self._run(jobs, remember=True), strict=True):
            session.last_tree, session.prefetched = tree, {}
            session.guesses, session.hints = guesses, hints
            trees.append(tree)
        return trees

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
        """:meth:`accept_checked` for several sessions, each named once: where verification left
        each last tree is found in one compiled pass over them all, and the calibration takes
        every first guess at once."""
        items = [item for item in items if item[1].size]
        if not items:
            return
        verified = [j for j, (s, _, _) in enumerate(items) if s.last_tree is not None]
        # By default the branches rejected are the best ones leaving the accepted path where
        # verification stopped, each extended by its best-scoring descendants.
        found: dict[int, tuple[int, list[tuple[int, ...]]]] = {}
        if verified:
            found = dict(zip(verified, self._outcomes([items[j] for j in verified]), strict=True))
        self._calibrate(items)
        for j, (session, new, rejected) in enumerate(items):
            ahead = select(session.prefetched, new) if session.prefetched else None
            if session.prefetched and session.last_tree is not None:
                self.counters.ahead_hits += ahead is not None
                self.counters.ahead_misses += ahead is None
            before = len(session.context)
            session.context.extend(new)
            # Each branch is keyed by the context tail where it branched off.
            if rejected:
                session.rejected.record_at(session.context.tokens, [(before + at, b) for at, b in rejected])
            elif rejected is None and j in found:
                depth, followers = found[j]
                if followers:
                    session.rejected.record_followers(session.context.tokens, before + depth, followers)
            # A tree drafted ahead for this outcome is what the decoder verifies next.
            session.last_tree, session.guesses, session.prefetched = ahead, None, {}
            n_ctx, n_lifetime = session.hints  # a match that continues is the new tokens longer
            session.hints = (n_ctx + new.size if n_ctx else 0, n_lifetime + new.size if n_lifetime else 0)

    def _calibrate(self, items: Sequence[tuple[Session, np.ndarray, Branches | None]]) -> None:
        """Count each session's first guesses of its last draft against the first token the
        target produced, in order, one compiled call per run of sessions drafted together."""
        runs: list[tuple[Guesses, list[int], list[int]]] = []
        for session, new, _ in items:
            if session.guesses is None:
                continue
            block, row = session.guesses
            if not runs or runs[-1][0] is not block:
                runs.append((block, [], []))
            runs[-1][1].append(row)
            runs[-1][2].append(int(new[0]))
        with self._lock:
            for block, rows, actual in runs:
                self.calibrator.update_rows(block, np.array(rows, dtype=np.int64), np.array(actual, dtype=np.int64))

    def _outcomes(
        self, items: Sequence[tuple[Session, np.ndarray, Branches | None]]
    ) -> list[tuple[int, list[tuple[int, ...]]]]:
        """Verifying each session's last tree against its new tokens: the accepted path's length
        and (without branches given) the branches rejected where it stopped, as token tuples;
        counted."""
        trees = [s.last_tree for s, _, _ in items if s.last_tree is not None]
        news = [new for _, new, _ in items]
        tok, par, sc, src, starts, ends = _stored(trees)
        path_lengths, by_tier, rows, lengths, first_row = kernels.verification_outcomes(
            tok,
            par,
            sc,
            src,
            starts,
            ends,
            _joined(news, np.int32),
            np.array([new.size for new in news], dtype=np.int64),
            np.array([_REJECTED_BRANCHES if rejected is None else 0 for _, _, rejected in items], dtype=np.int64),
            self.config.rejected.follower_len,
            len(_TIERS),
        )
        c = self.counters
        c.steps += len(trees)
        c.drafted += sum(len(t) for t in trees)
        for t, n in enumerate(by_tier.tolist()):
            if n:
                c.accepted[_TIER_NAMES[t]] += n
        # Rows already cut to the rejected table's follower length; one conversion for all.
        cut = [tuple(row[:n]) for row, n in zip(rows.tolist(), lengths.tolist(), strict=True)]
        bounds = first_row.tolist()
        return [(depth, cut[bounds[i] : bounds[i + 1]]) for i, depth in enumerate(path_lengths.tolist())]

    def prespeculate(self, session: Session, k: int, params: DraftParams) -> Prefetched:
        """Trees drafted ahead for the ``k`` likeliest outcomes of verifying the session's last
        tree (see :mod:`indexer.prespeculation`); the next :meth:`accept` goes on with the one
        the outcome selects. Session state is left as it was, apart from remembering them."""
        if not 0 <= k <= MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {k}")
        tree = session.last_tree
        ahead: Prefetched = {}
        if tree is not None and k > 0:
            # One level deeper: the bonus token becomes the root.
            depth = min(params.max_depth + 1, MAX_DEPTH, max(params.budget, 1))
            ctx = session.context.tokens
            points = stopping_points(tree, k)
            jobs = [
                _Job(session, np.concatenate((ctx, np.array(path, dtype=np.int32))), tuple(kids), params, depth)
                for path, kids in points
            ]
            # The outcomes are only supposed: nothing learnt about them stays.
            for (path, _), (drafted, _, _) in zip(points, self._run(jobs, remember=False), strict=True):
                ahead[path] = drafted
        session.prefetched = ahead
        return ahead

    def close(self, session: Session, *, commit: bool = True, commit_from: int = 0) -> np.ndarray | None:
        """Finish a request; with ``commit`` its tokens from ``commit_from`` join the lifetime
        buffer and its prompt -> output pair the exact-prompt cache. A long leading part the
        memory already holds (the earlier turns a multi-turn request repeats) is not added
        again, past an overlap of ``max_match`` tokens that keeps the junction searchable.
        Returns the tokens added."""
        return self.close_many([(session, commit_from)])[0] if commit else None

    def close_many(self, closing: Sequence[tuple[Session, int]]) -> list[np.ndarray]:
        """:meth:`close` with commit for several requests ``(session, commit_from)`` at once,
        indexed together (one run of the lifetime memory's delta, not one each)."""
        added, exact = [], []
        for session, commit_from in closing:
            tokens = session.context.tokens
            if not 0 <= commit_from <= tokens.size:
                raise ValueError(f"commit_from must be in [0, {tokens.size}], got {commit_from}")
            known = self.memory.known_prefix(tokens) - self.config.max_match
            start = max(commit_from, known if known >= MIN_SKIP else 0)
            added.append(tokens[start:].copy())
            exact.append((tokens[: session.prompt_len], session.generated))
        self.memory.commit_many(added, exact=exact)
        return added

    # -- tiers -------------------------------------------------------------------------------

    def _run(
        self, jobs: Sequence[_Job], *, remember: bool
    ) -> list[tuple[DraftTree, tuple[Guesses, int], tuple[int, int]]]:
        """Each job's tree, first guesses and hints, all drafted in one compiled call (see
        :func:`~indexer.kernels.draft.draft_batch`). The tiers kept in Python objects (the
        rejected table, the prior, the exact-prompt cache) are looked up here first; with
        ``remember`` the exact tier keeps how far each output agrees with its cached one."""
        batch = _Batch()
        for job in jobs:
            s, ctx = job.session, job.context
            batch.add_sequence(job, since=max(0, s.prompt_len - self.config.dynamic.window))
            found = s.rejected.table.candidates(ctx)
            if found is not None:
                batch.add_part(*found, per_cell=False, tier=Tier.REJECTED, n=s.rejected.table.config.leader_len)
            hit = self.prior.lookup(ctx) if self.prior is not None else None
            if hit is not None:
                batch.add_part(hit.rows, hit.probs, per_cell=True, tier=Tier.PRIOR, n=hit.order)
            exact = self._exact(s, ctx, job.depth, remember)
            if exact is not None:
                rest, n = exact
                batch.add_part(rest[None, :], _ONE_WEIGHT, per_cell=False, tier=Tier.EXACT, n=n)
        hits, predicted = self.calibrator.counts()
        tokens, parents, sources, scores, ends, first_tok, guess, lengths = _draft_batch(
            batch.arrays(), self.memory.search_arrays(), self._settings, hits, predicted, self.threads
        )
        bounds, found_n = ends.tolist(), lengths.tolist()
        guesses = Guesses(first_tok, guess, lengths)
        drafted = TreeBatch(tokens, parents, sources, scores, ends)
        out = []
        for j in range(len(jobs)):
            a, b = bounds[j], bounds[j + 1]
            tree = DraftTree(tokens[a:b], parents[a:b], sources[a:b], scores[a:b], drafted, j)
            ns = found_n[j]
            out.append((tree, (guesses, j), (ns[Tier.CONTEXT], ns[Tier.LIFETIME_SA])))
        return out

    def _exact(self, s: Session, ctx: np.ndarray, depth: int, remember: bool) -> tuple[np.ndarray, int] | None:
        """The rest of the response cached for an identical prompt, while the output so far
        (``ctx`` past the prompt) agrees with it, and the match length it stands for."""
        if s.exact is None:
            return None
        done = ctx[s.prompt_len :]
        known = s.exact_agrees
        if known < 0 or done.size >= s.exact.size:
            return None
        if known < done.size:  # only the tokens generated since the last check are compared
            agrees = s.exact[known : done.size].tolist() == done[known:].tolist()  # a few tokens: lists beat numpy
            if remember:
                s.exact_agrees = int(done.size) if agrees else -1
            if not agrees:
                return None
        return s.exact[done.size : done.size + depth], max(1, int(done.size) + 1)

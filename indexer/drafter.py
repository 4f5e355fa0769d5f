"""Drafting for one namespace: every tier queried, scored, merged into one tree.

Each tier turns a match into rows of continuations with prefix probabilities (how often each
prefix followed the match). A tier's probabilities are scaled by its confidence: a prior that
grows with the match length, times a calibration factor learned online from which tier's first
guess the target actually accepted, per tier and match length. So a tier earns its place in the
tree by its track record on this namespace, not by a hand-set weight.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from indexer import kernels
from indexer.calibration import Calibrator
from indexer.lifetime_index import LifetimeConfig, LifetimeMemory, prompt_key
from indexer.prespeculation import Prefetched, select, stopping_points
from indexer.prior import StaticPrior
from indexer.session import Guess, Session, SessionSnapshot
from indexer.session_cache import LruTableConfig
from indexer.tokens import Namespace, as_tokens
from indexer.tree_builder import Candidates, DraftTree, MergeJob, Tier, merge_many

_TIER_NAMES = [t.name for t in Tier]  # by value: counting by name without building enums
MAX_BUDGET = 1024
MAX_DEPTH = 128
MAX_LOOKAHEAD = 16  # outcomes drafted ahead per step
MIN_SKIP = 256  # a known leading part shorter than this is committed again (not worth a cut)
_REJECTED_BRANCHES = 4  # branches remembered where verification left a tree


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


def _without_first(c: Candidates, exclude: frozenset[int]) -> Candidates:
    """``c`` without the rows starting with an excluded token."""
    if not exclude or c.rows.size == 0:
        return c
    keep = ~np.isin(c.rows[:, 0], np.fromiter(exclude, dtype=np.int32, count=len(exclude)))
    if keep.all():
        return c
    return Candidates(
        c.tier,
        c.rows[keep],
        weights=None if c.weights is None else c.weights[keep],
        probs=None if c.probs is None else c.probs[keep],
        confidence=c.confidence,
    )


_HALF_BY_TIER = [_HALF[t] for t in Tier]  # indexed by tier value (Tier iterates in value order)
_ONE_WEIGHT = np.ones(1)  # the exact tier's single row (candidates are never written to)


def _prior(tier: Tier, n: int) -> float:
    return n / (n + _HALF_BY_TIER[tier])


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

    def __post_init__(self) -> None:
        for name in ("max_match", "samples", "context_samples", "calibration_buckets"):
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
        kernels.warm_up()  # compile or load the compiled loops now, not on the first draft

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
        job, lengths = self.plan(session, params)
        tree, firsts = merge_many([job])[0]
        self.settle(session, tree, firsts, lengths)
        return tree

    def plan(self, session: Session, params: DraftParams) -> tuple[MergeJob, dict[Tier, int]]:
        """:meth:`draft` up to the merge: every tier's candidates as a job for
        :func:`~indexer.tree_builder.merge_many` (so a batch's trees merge in one call), and
        the match length behind each tier. :meth:`settle` takes the merged tree."""
        depth = min(params.max_depth, max(params.budget, 1))  # a path never holds more nodes than the tree
        found = self._candidates(session, depth)
        job = MergeJob([c for c, _ in found], params.budget, depth, params.min_score, params.depth_reserve)
        return job, {c.tier: n for c, n in found}

    def settle(
        self, session: Session, tree: DraftTree, firsts: dict[Tier, tuple[int, float]], lengths: dict[Tier, int]
    ) -> None:
        """The session drafted ``tree`` (merged from its :meth:`plan`): remember it, and each
        tier's first guess for calibration once the outcome is known."""
        session.last_tree, session.prefetched = tree, {}
        session.guesses = [Guess(t, lengths[t], tok, p * _prior(t, lengths[t])) for t, (tok, p) in firsts.items()]
        session.hints = lengths

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

    def accept_checked(
        self, session: Session, new: np.ndarray, rejected: Sequence[tuple[int, np.ndarray]] | None = None
    ) -> None:
        """:meth:`accept` for tokens (and branches, their offsets in range) already checked
        against the namespace: a contiguous int32 array with every id in the vocabulary."""
        if new.size == 0:
            return
        ahead = select(session.prefetched, new) if session.prefetched else None
        tree = session.last_tree
        path = None
        branches: Sequence[tuple[int, np.ndarray]] = [] if rejected is None else rejected
        if tree is not None and len(tree):
            # By default the branches rejected are the best ones leaving the accepted path where
            # verification stopped, each extended by its best-scoring descendants.
            limit = _REJECTED_BRANCHES if rejected is None else 0
            path, rows, lengths = kernels.verification_outcome(tree.tokens, tree.parents, tree.scores, new, limit)
            if rejected is None:
                branches = [(int(path.size), rows[j, :n]) for j, n in enumerate(lengths.tolist())]
        self._count(session, path, ahead is not None)
        self._calibrate(session, int(new[0]))
        if branches:  # each keyed by the context tail where it branched off
            before = session.context.tokens[-self.config.rejected.leader_len :].tolist()
            tail = before + new.tolist()
            for depth, branch in branches:
                session.rejected.record_at(tail, len(before) + depth, branch)
        session.context.extend(new)
        # A tree drafted ahead for this outcome is what the decoder verifies next.
        session.last_tree, session.guesses, session.prefetched = ahead, [], {}
        session.hints = {t: n + int(new.size) for t, n in session.hints.items()}

    def prespeculate(self, session: Session, k: int, params: DraftParams) -> Prefetched:
        """Trees drafted ahead for the ``k`` likeliest outcomes of verifying the session's last
        tree (see :mod:`indexer.prespeculation`); the next :meth:`accept` goes on with the one
        the outcome selects. Session state is left as it was, apart from remembering them."""
        if not 0 <= k <= MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {k}")
        tree = session.last_tree
        ahead: Prefetched = {}
        if tree is not None and k > 0:
            for path, children in stopping_points(tree, k):
                ahead[path] = self._draft_after(session, np.array(path, dtype=np.int32), children, params)
        session.prefetched = ahead
        return ahead

    def _draft_after(self, s: Session, path: np.ndarray, exclude: frozenset[int], params: DraftParams) -> DraftTree:
        """The tree for the context extended by ``path``, without root children in ``exclude``
        (one level deeper: the bonus token becomes the root)."""
        depth = min(params.max_depth + 1, MAX_DEPTH, max(params.budget, 1))  # the bonus token is the root
        before, agrees = len(s.context), s.exact_agrees
        s.context.extend(path)
        try:
            found = self._candidates(s, depth)
        finally:  # the outcome is only supposed: nothing learnt about it stays
            s.context.truncate(before)
            s.exact_agrees = agrees
        parts = [_without_first(c, exclude) for c, _ in found]
        return merge_many([MergeJob(parts, params.budget, depth, params.min_score, params.depth_reserve)])[0][0]

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

    def _candidates(self, s: Session, depth: int) -> list[tuple[Candidates, int]]:
        """Each tier's candidates with the match length that produced them."""
        ctx = s.context.tokens
        cfg = self.config
        out: list[tuple[Candidates, int]] = []
        n, rows, w = s.context.lookup(
            max_len=cfg.max_match, depth=depth, samples=cfg.context_samples, hint=s.hints.get(Tier.CONTEXT, 0)
        )
        if n:
            out.append((self._weighted(Tier.CONTEXT, n, rows, w), n))
        dyn = cfg.dynamic
        rows, w = s.context.followers(
            leader_len=dyn.leader_len,
            follower_len=dyn.follower_len,
            keep=dyn.max_followers,
            since=max(0, s.prompt_len - dyn.window),
        )
        if w.size:
            out.append((self._weighted(Tier.DYNAMIC, dyn.leader_len, rows, w), dyn.leader_len))
        found = s.rejected.table.candidates(ctx)
        if found is not None:
            rows, w = found
            n = s.rejected.table.config.leader_len
            out.append((self._weighted(Tier.REJECTED, n, rows, w), n))
        out.extend(self._lifetime(ctx, depth, s.hints.get(Tier.LIFETIME_SA, 0)))
        if self.prior is not None:
            hit = self.prior.lookup(ctx)
            if hit is not None:
                out.append(
                    (
                        Candidates(Tier.PRIOR, hit.rows, probs=hit.probs, confidence=self._conf(Tier.PRIOR, hit.order)),
                        hit.order,
                    )
                )
        exact = self._exact(s, depth)
        if exact is not None:
            out.append(exact)
        return out

    def _conf(self, tier: Tier, n: int) -> float:
        return min(1.0, _prior(tier, n) * self.calibrator.factor(tier, n))

    def _weighted(self, tier: Tier, n: int, rows: np.ndarray, weights: np.ndarray) -> Candidates:
        return Candidates(tier, rows, weights=weights, confidence=self._conf(tier, n))

    def _lifetime(self, ctx: np.ndarray, depth: int, hint: int) -> list[tuple[Candidates, int]]:
        """The longest match over the main and delta suffix indexes; a match no longer than the
        frozen table's leaders is answered by the table's exact top followers instead."""
        cfg = self.config
        best, rows, weights = self.memory.continuations(
            ctx, max_len=cfg.max_match, depth=depth, samples=cfg.samples, hint=hint
        )
        if best == 0:
            return []
        indexes = self.memory.indexes
        if indexes is not None and best <= indexes.table.config.leader_len:
            ll = indexes.table.config.leader_len
            hit = indexes.table.lookup(ctx)
            if hit is not None:
                conf = self._conf(Tier.LIFETIME_NGRAM, ll)
                return [(Candidates(Tier.LIFETIME_NGRAM, hit[0], probs=hit[1], confidence=conf), ll)]
        return [(self._weighted(Tier.LIFETIME_SA, best, rows, weights), best)]

    def _exact(self, s: Session, depth: int) -> tuple[Candidates, int] | None:
        if s.exact is None:
            return None
        done = s.generated
        known = s.exact_agrees
        if known < 0 or done.size >= s.exact.size:
            return None
        if known < done.size:  # only the tokens generated since the last check are compared
            if s.exact[known : done.size].tolist() != done[known:].tolist():  # a few tokens: lists beat numpy
                s.exact_agrees = -1
                return None
            s.exact_agrees = int(done.size)
        rest = s.exact[done.size : done.size + depth]
        n = max(1, int(done.size) + 1)
        return Candidates(Tier.EXACT, rest[None, :], weights=_ONE_WEIGHT, confidence=self._conf(Tier.EXACT, n)), n

    def _count(self, s: Session, path: np.ndarray | None, ahead: bool) -> None:
        """Count the outcome of verifying the session's last tree (``path``: the accepted nodes)."""
        tree = s.last_tree
        if tree is None:
            return
        c = self.counters
        c.steps += 1
        c.drafted += tree.tokens.size
        if s.prefetched:
            c.ahead_hits += ahead
            c.ahead_misses += not ahead
        if path is not None and path.size:
            for src in tree.sources[path].tolist():
                c.accepted[_TIER_NAMES[src]] += 1

    def _calibrate(self, s: Session, actual: int) -> None:
        if s.guesses:
            with self._lock:
                self.calibrator.update_many(s.guesses, actual)

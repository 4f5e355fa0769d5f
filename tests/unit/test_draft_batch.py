"""The compiled batch draft step against a reference built from the single-tier searches and
the tree merge, one session at a time."""

import inspect
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest

from indexer import kernels
from indexer.calibration import Guess
from indexer.drafter import (
    _HALF,
    MIN_PER_THREAD,
    DrafterConfig,
    DraftParams,
    NamespaceDrafter,
    step_threads,
    warm_draft_step,
)
from indexer.kernels import draft as draft_kernel
from indexer.kernels.successors import successor_extensions
from indexer.kernels.tree import stack_parts
from indexer.lifetime_index import LifetimeIndexes
from indexer.ngram_table import NgramTable
from indexer.prespeculation import stopping_points
from indexer.prior import PriorConfig, StaticPrior
from indexer.session import Session
from indexer.suffix_array import SuffixIndex
from indexer.tokens import SEPARATOR, Namespace
from indexer.tree_builder import Candidates, DraftTree, Tier, flat_parts, merge_candidates

VOCAB = 40
NS = Namespace(name="batch", vocab_size=VOCAB)


def test_kernel_tier_values_are_the_tiers():
    names = ("DYNAMIC", "CONTEXT", "REJECTED", "LIFETIME_SA", "LIFETIME_NGRAM", "PRIOR", "SUCCESSOR")
    assert [getattr(draft_kernel, n) for n in names] == [int(Tier[n]) for n in names]


def test_half_precision_bits_decode_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    got = draft_kernel.half_to_float(bits)
    want = bits.view(np.float16).astype(np.float64)
    assert np.array_equal(got, want, equal_nan=True)


def _reference(d: NamespaceDrafter, s: Session, params: DraftParams, ctx=None, exclude=(), depth=None):
    """Every tier searched on its own, then merged: what one session's tree must be."""
    ctx = s.context.tokens if ctx is None else ctx
    cfg, dyn, cal = d.config, d.config.dynamic, d.calibrator
    depth = min(params.max_depth, max(params.budget, 1)) if depth is None else depth
    stop = int(SEPARATOR)
    parts = []

    def confidence(tier, n):
        return min(1.0, n / (n + _HALF[tier]) * cal.factor(tier, n))

    def add(tier, n, rows, weights=None, probs=None):
        conf = confidence(tier, n)
        keep = ~np.isin(rows[:, 0], list(exclude)) if exclude and rows.size else np.ones(rows.shape[0], bool)
        if keep.any():
            parts.append(
                Candidates(
                    tier,
                    rows[keep],
                    weights=None if weights is None else weights[keep],
                    probs=None if probs is None else probs[keep].astype(np.float64),
                    confidence=conf,
                )
            )

    tokens, sa = s.context.prompt_index
    n, rows, w = kernels.context_continuations(
        ctx, tokens, sa, s.context.indexed, cfg.max_match, 0, depth, cfg.context_samples, stop
    )
    if n:
        add(Tier.CONTEXT, n, rows, weights=w)
    since = max(0, s.prompt_len - dyn.window)
    rows, w = kernels.context_followers(
        ctx, tokens, sa, s.context.indexed, since, dyn.leader_len, dyn.follower_len, dyn.max_followers
    )
    if w.size:
        add(Tier.DYNAMIC, dyn.leader_len, rows, weights=w)
    found = s.rejected.table.candidates(ctx)
    if found is not None:
        add(Tier.REJECTED, s.rejected.table.config.leader_len, found[0], weights=found[1])
    best, rows, w = d.memory.continuations(ctx, max_len=cfg.max_match, depth=depth, samples=cfg.samples)
    indexes = d.memory.indexes
    hit = None
    if best and indexes is not None and best <= indexes.table.config.leader_len:
        hit = indexes.table.lookup(ctx)
    if hit is not None:
        add(Tier.LIFETIME_NGRAM, indexes.table.config.leader_len, hit[0], probs=hit[1])
    elif best:
        add(Tier.LIFETIME_SA, best, rows, weights=w)
    prior = d.prior.lookup(ctx) if d.prior is not None else None
    if prior is not None:
        add(Tier.PRIOR, prior.order, prior.rows, probs=prior.probs)
    done = ctx[s.prompt_len :]
    if s.exact is not None and done.size < s.exact.size and np.array_equal(s.exact[: done.size], done):
        add(Tier.EXACT, max(1, done.size + 1), s.exact[None, done.size : done.size + depth], weights=np.ones(1))
    rows, probs = kernels.successor_rows(
        *d.successors.kernel_args(), int(ctx[-1]) if ctx.size else -1, depth, draft_kernel.SUCCESSOR_MIN_PROB
    )
    if rows.shape[0]:
        add(Tier.SUCCESSOR, 1, rows, probs=probs)
    extended = _successor_extensions(d, parts, depth, confidence(Tier.SUCCESSOR, 1))
    if extended is not None:  # before the tier's own rows, which give its first guess
        own = len(parts) - 1 if parts[-1].tier == Tier.SUCCESSOR else len(parts)
        parts.insert(own, extended)
    return merge_candidates(
        parts, budget=params.budget, max_depth=depth, min_score=params.min_score, depth_reserve=params.depth_reserve
    )


def _successor_extensions(d: NamespaceDrafter, parts: list[Candidates], depth: int, conf: float) -> Candidates | None:
    """The successor rows the draft step adds under the other tiers' first tokens (the tier's
    confidence ``conf``), as a part whose values are final (confidence 1), or ``None``."""
    if not parts or depth < 1:
        return None
    rows, vals, _, tiers = stack_parts(*flat_parts(parts), depth)
    ext, worth = successor_extensions(
        rows, vals, tiers, int(Tier.SUCCESSOR), *d.successors.kernel_args(), draft_kernel.SUCCESSOR_ROOT_MIN_PROB,
        conf, draft_kernel.SUCCESSOR_ROOTS,
    )  # fmt: skip
    return Candidates(Tier.SUCCESSOR, ext, probs=worth, confidence=1.0) if ext.shape[0] else None


def _guesses(s: Session) -> list[Guess]:
    assert s.guesses is not None
    block, row = s.guesses
    return block.of(row)


def _world(seed: int):
    """A drafter whose every tier has something to say: a main lifetime index and delta runs,
    a prior, sessions with indexed prompts, outputs, rejected branches and an exact response."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, VOCAB, size=rng.integers(3, 9)).astype(np.int32) for _ in range(12)]

    def text(n):
        return np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), size=n)])

    corpus = text(200)
    prior = StaticPrior.build(corpus, PriorConfig(orders=(1, 2, 3), follower_len=4))
    d = NamespaceDrafter(NS, DrafterConfig(), prior)
    d.memory.commit_many([text(30) for _ in range(8)])
    d.memory.rebuild()
    d.memory.commit_many([text(20) for _ in range(3)])  # delta runs beside the main index
    d.memory.commit_many([text(20)])
    repeated = text(60)  # a prompt whose earlier response is known
    answer = text(8)
    opened = d.open(repeated)
    opened.context.extend(answer)
    d.close(opened)
    sessions = [d.open(repeated)] + [d.open(text(int(rng.integers(1, 80)))) for _ in range(9)]
    for step in range(6):
        for i, s in enumerate(sessions):
            d.draft(s, DraftParams())
            new = answer[step : step + 1] if i == 0 else text(1)[: int(rng.integers(1, 4))]
            if i % 2:  # the target's top-3 where the step was verified: the successor tier's rows
                top = rng.integers(0, VOCAB, size=(new.size, 3)).astype(np.int32)
                top[:, 0] = new
                d.observe_topk(s, new, top)
            d.accept(s, new)
    back = d.open(np.concatenate([text(5), np.array([11, 12], dtype=np.int32)]))
    d.accept(back, [13], rejected=[(0, [20, 21, 22])])  # rejected after "11 12" ...
    d.accept(back, [11, 12])  # ... which the context ends with again
    return d, [*sessions, back]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "params",
    [DraftParams(), DraftParams(budget=7, max_depth=3, depth_reserve=2), DraftParams(budget=48, min_score=0.05)],
)
def test_batch_trees_are_each_sessions_tiers_merged(seed, params):
    d, sessions = _world(seed)
    tiers_seen = set()
    want = [_reference(d, s, params) for s in sessions]
    got = d.draft_many([(s, params) for s in sessions])
    for (tree, firsts), drafted, s in zip(want, got, sessions, strict=True):
        for name in ("tokens", "parents", "sources", "scores"):
            assert np.array_equal(getattr(drafted, name), getattr(tree, name)), name
        assert {g.tier: g.token for g in _guesses(s)} == {t: tok for t, (tok, _) in firsts.items()}
        tiers_seen |= set(firsts)
    assert tiers_seen == set(Tier)  # every tier took part somewhere


def test_guesses_predict_the_first_token_probability_under_their_tier():
    d, sessions = _world(7)
    params = DraftParams()
    for s in sessions:
        _, firsts = _reference(d, s, params)
        d.draft(s, params)
        lengths = {g.tier: g.n for g in _guesses(s)}
        for g in _guesses(s):
            tok, p = firsts[g.tier]
            assert g.token == tok
            assert g.predicted == pytest.approx(p * lengths[g.tier] / (lengths[g.tier] + _HALF[g.tier]), rel=1e-12)


def test_a_sessions_tree_does_not_depend_on_its_batch():
    d, sessions = _world(3)
    alone = [d.draft(s, DraftParams()) for s in sessions]
    together = d.draft_many([(s, DraftParams()) for s in reversed(sessions)])[::-1]
    for a, b in zip(alone, together, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


@pytest.mark.parametrize("calibrated", [False, True], ids=["scores", "calibrated"])
def test_trees_drafted_ahead_are_the_supposed_contexts_merged_without_the_excluded_roots(monkeypatch, calibrated):
    from indexer import drafter as drafter_module
    from indexer.kernels import chain_reach

    if calibrated:  # the points ranked by the chain calibrator's acceptance, as once it has learnt enough
        monkeypatch.setattr(drafter_module, "_CALIBRATED_AFTER", 0)
    d, sessions = _world(5)
    params = DraftParams(budget=24)
    for s in sessions:
        d.draft(s, params)
        ahead = d.prespeculate(s, 4, params)
        depth = min(params.max_depth + 1, 128, max(params.budget, 1))
        t = s.last_tree
        if calibrated:
            reach = chain_reach(t.parents, d.chain_calibrator.conditional(t, s.track)).astype(np.float32)
            t = DraftTree(t.tokens, t.parents, t.sources, reach)
        points = stopping_points(t, 4)
        assert len(ahead) == len(points)
        for path, kids in points:
            ctx = np.concatenate([s.context.tokens, np.array(path, dtype=np.int32)])
            want, _ = _reference(d, s, params, ctx=ctx, exclude=kids, depth=depth)
            assert ahead[path].tokens.tolist() == want.tokens.tolist()
            assert ahead[path].parents.tolist() == want.parents.tolist()
            roots = ahead[path].tokens[ahead[path].parents == -1].tolist()
            assert not set(roots) & set(kids)


def _adopted(d: NamespaceDrafter, *, read_only: bool) -> NamespaceDrafter:
    """A drafter serving copies of ``d``'s main lifetime indexes, as a replica mapping a shared
    generation does (memory-mapped files are read-only arrays)."""

    def copy(a):
        a = a.copy()
        a.setflags(write=not read_only)
        return a

    idx = d.memory.indexes
    table = NgramTable.from_arrays(idx.table.config, {n: copy(a) for n, a in idx.table.arrays().items()})
    suffix = SuffixIndex(copy(idx.suffix.tokens), copy(idx.suffix.suffix_array))
    served = NamespaceDrafter(NS, DrafterConfig(), d.prior, own_ring=False)
    served.memory.adopt(LifetimeIndexes(suffix, table, idx.version, idx.build_seconds), (0, 0))
    return served


def test_read_only_indexes_are_compiled_for_before_use_and_draft_the_same_trees():
    d, sessions = _world(2)
    writable, read_only = _adopted(d, read_only=False), _adopted(d, read_only=True)
    arrays = read_only.memory.search_arrays()
    assert not arrays.main_tokens.flags.writeable and not arrays.table_probs.flags.writeable

    def read_only_signatures():
        main = list(inspect.signature(kernels.draft_batch.py_func).parameters).index("main_tokens")
        return [sig for sig in kernels.draft_batch.signatures if "readonly" in str(sig[main])]

    warm_draft_step(arrays)
    assert read_only_signatures()  # compiled now, not by the first request
    for s in sessions:
        a, b = writable.draft(s, DraftParams()), read_only.draft(s, DraftParams())
        assert a.tokens.tolist() == b.tokens.tolist() and a.scores.tolist() == b.scores.tolist()


def _outcome(tree, rng) -> np.ndarray:
    """Tokens a target could produce after ``tree``: some of a root path, then a token of its own."""
    node, path = -1, []
    for _ in range(int(rng.integers(0, 5))):
        kids = np.flatnonzero(tree.parents == node)
        if not kids.size:
            break
        node = int(kids[rng.integers(0, kids.size)])
        path.append(int(tree.tokens[node]))
    return np.array([*path, int(rng.integers(0, VOCAB))], dtype=np.int32)


def _state(d: NamespaceDrafter, sessions: list[Session]):
    per_session = [
        (s.context.tokens.tolist(), s.rejected.table.items(), s.hints, s.last_tree is None, s.guesses is None)
        for s in sessions
    ]
    return per_session, d.calibrator.table(), d.counters


def _accept_alone(d: NamespaceDrafter, s: Session, new: np.ndarray, given) -> None:
    """One session taking its new tokens, step by step, from the single-tree kernels."""
    if not new.size:
        return
    branches = given or []
    if s.last_tree is not None:
        tree = s.last_tree
        path, rows, lengths = kernels.verification_outcome(
            tree.tokens, tree.parents, tree.scores, new, 0 if given is not None else 4
        )
        if given is None:
            branches = [(path.size, rows[j, :n]) for j, n in enumerate(lengths)]
        d.counters.steps += 1
        d.counters.drafted += len(tree)
        for src in tree.sources[path]:
            d.counters.accepted[Tier(src).name] += 1
    for g in _guesses(s) if s.guesses is not None else []:
        d.calibrator.update(g.tier, g.n, predicted=g.predicted, hit=g.token == new[0])
    grown = np.concatenate([s.context.tokens, new])
    for at, branch in branches:
        s.rejected.record(grown[: len(s.context) + at], branch)
    s.context.extend(new)
    s.last_tree, s.guesses = None, None
    s.hints = tuple(h + new.size if h else 0 for h in s.hints)


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_accepts_as_its_sessions_one_after_another(seed):
    """Outcomes, rejected branches (found or given), calibration and counts come out as if each
    session took its tokens alone, in the batch's order."""
    (one, one_sessions), (many, many_sessions) = _world(seed), _world(seed)
    for d, sessions in ((one, one_sessions), (many, many_sessions)):
        d.draft_many([(s, DraftParams()) for s in sessions[:-1]])  # the last session holds no tree
    rng = np.random.default_rng(seed)
    news = [_outcome(s.last_tree, rng) if s.last_tree is not None else np.array([4, 5], np.int32) for s in one_sessions]
    news[3] = np.zeros(0, dtype=np.int32)  # nothing new: left as it is
    given = {1: [(0, np.array([30, 31, 32], np.int32))], 5: []}  # branches the decoder names (none: none)
    for j, (s, new) in enumerate(zip(one_sessions, news, strict=True)):
        _accept_alone(one, s, new, given.get(j))
    many.accept_many([(s, new, given.get(j)) for j, (s, new) in enumerate(zip(many_sessions, news, strict=True))])
    assert _state(one, one_sessions) == _state(many, many_sessions)
    assert sum(many.counters.accepted.values()) > 0
    assert any(s.rejected.table.items() for s in many_sessions[6:])  # branches were found and kept
    params = DraftParams()
    for a, b in zip(
        one.draft_many([(s, params) for s in one_sessions]),
        many.draft_many([(s, params) for s in many_sessions]),
        strict=True,
    ):
        assert a.tokens.tolist() == b.tokens.tolist() and a.scores.tolist() == b.scores.tolist()


@pytest.mark.parametrize("where", ["joined", "in their batch, shuffled"])
def test_batch_outcomes_are_each_trees_outcome(where):
    rng = np.random.default_rng(5)
    d, sessions = _world(4)
    drafted = d.draft_many([(s, DraftParams()) for s in sessions])
    if where == "joined":
        trees = drafted
        ends = np.cumsum([len(t) for t in trees], dtype=np.int64)
        stored = tuple(
            np.concatenate([getattr(t, f) for t in trees]) for f in ("tokens", "parents", "scores", "sources")
        )
        bounds = (ends - [len(t) for t in trees], ends)
    else:  # read where the draft step left them, in another order
        trees = [drafted[j] for j in rng.permutation(len(drafted))]
        batch = trees[0].batch
        assert batch is not None and all(t.batch is batch for t in trees)
        rows = np.array([t.row for t in trees])
        stored, bounds = (
            (batch.tokens, batch.parents, batch.scores, batch.sources),
            tuple(batch.offsets[rows + k] for k in (0, 1)),
        )
    news = [_outcome(t, rng) for t in trees]
    limits = rng.integers(0, 5, size=len(trees))
    width = 3
    path_lengths, by_tier, rows, lengths, first_row = kernels.verification_outcomes(
        *stored, *bounds, np.concatenate(news), np.array([n.size for n in news], dtype=np.int64), limits, width,
        len(Tier),
    )  # fmt: skip
    counted = np.zeros(len(Tier), dtype=np.int64)
    for j, (t, new) in enumerate(zip(trees, news, strict=True)):
        path, want_rows, want_lengths = kernels.verification_outcome(t.tokens, t.parents, t.scores, new, limits[j])
        assert path_lengths[j] == path.size
        np.add.at(counted, t.sources[path], 1)
        got = rows[first_row[j] : first_row[j + 1]]
        assert [r[:n].tolist() for r, n in zip(got, lengths[first_row[j] : first_row[j + 1]], strict=True)] == [
            r[: min(n, width)].tolist() for r, n in zip(want_rows, want_lengths, strict=True)
        ]
    assert by_tier.tolist() == counted.tolist() and by_tier.sum() > 0
    assert first_row[-1] > 0  # some tree was left where branches were kept


@pytest.mark.parametrize("seed", range(2))
def test_threaded_step_drafts_what_one_thread_drafts(seed):
    d, sessions = _world(seed)
    params = [DraftParams(), DraftParams(budget=0), DraftParams(budget=5, max_depth=2)]
    items = [(s, params[i % len(params)]) for i, s in enumerate(sessions)]  # some trees are empty
    alone = d.draft_many(items)
    d.threads = 2
    shared = d.draft_many(items)
    assert kernels.draft_batch_parallel.signatures  # the threaded step ran
    assert any(len(t) for t in shared) and any(not len(t) for t in shared)
    for a, b in zip(alone, shared, strict=True):
        for name in ("tokens", "parents", "sources", "scores"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_threaded_steps_from_several_threads_at_once():
    """A service may draft from more than one thread; each call's trees stay its own."""
    worlds = [_world(seed) for seed in (3, 4)]
    want = [d.draft_many([(s, DraftParams()) for s in sessions]) for d, sessions in worlds]
    config = DrafterConfig(threads=2)
    threaded = NamespaceDrafter(NS, config)
    assert threaded.threads == (2 if numba.threading_layer() in ("omp", "tbb") else 1)
    for d, _ in worlds:
        d.threads = threaded.threads

    def run(k: int) -> list:
        d, sessions = worlds[k]
        return [d.draft_many([(s, DraftParams()) for s in sessions]) for _ in range(20)]

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(run, range(2)))
    for k in range(2):
        for trees in got[k]:
            assert [t.tokens.tolist() for t in trees] == [t.tokens.tolist() for t in want[k]]


def test_draft_threads_must_be_positive():
    with pytest.raises(ValueError, match="threads"):
        DrafterConfig(threads=0)


def test_threaded_step_takes_the_same_named_arguments():
    """Named, like the one-thread step's: dispatching a star-args signature costs more than
    the trees of a small batch."""
    one = inspect.signature(kernels.draft_batch.py_func).parameters
    shared = inspect.signature(kernels.draft_batch_parallel.py_func).parameters
    assert list(shared) == list(one)
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in shared.values())


@pytest.mark.parametrize(
    ("configured", "sequences", "want"),
    [(2, 0, 1), (2, 1, 1), (2, 5, 1), (2, 6, 2), (2, 32, 2), (4, 9, 3), (4, 32, 4), (1, 32, 1)],
)
def test_small_batches_draft_on_fewer_threads(configured, sequences, want):
    """Waking worker threads costs about as much as two or three trees: each takes at least
    MIN_PER_THREAD sequences."""
    assert step_threads(configured, sequences) == want
    assert want == 1 or sequences // want >= MIN_PER_THREAD

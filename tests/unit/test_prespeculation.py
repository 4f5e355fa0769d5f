import numpy as np
import pytest

from indexer.drafter import AHEAD_CHAINS, DrafterConfig, DraftParams, NamespaceDrafter
from indexer.kernels import draft as draft_kernel
from indexer.kernels.draft_chain import draft_chain_batch
from indexer.prespeculation import chain_stopping_points, fans, likeliest_outcomes, select, stopping_points, subtree
from indexer.tokens import Namespace
from indexer.tree_builder import DraftedTrees, DraftTree, TreeBatch


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _tree(tokens, parents, scores):
    n = len(tokens)
    return DraftTree(_a(tokens), _a(parents), np.zeros(n, np.uint8), np.array(scores, np.float32))


# 5 -> 6 -> 7 and 5 -> 8, plus a second root child 9.
T = _tree([5, 6, 7, 8, 9], [-1, 0, 1, 0, -1], [0.9, 0.5, 0.4, 0.15, 0.05])


def test_stopping_points_ranked_by_chance_of_ending_there():
    # Ending exactly at a node: its score minus its children's. Root: 1 - .9 - .05 = .05;
    # 5: .9 - .5 - .15 = .25; 6: .5 - .4 = .1; 7: .4; 8: .15; 9: .05.
    got = stopping_points(T, 3)
    assert [path for path, _ in got] == [(5, 6, 7), (5,), (5, 8)]
    # Each comes with the tokens of that node's children (the bonus token is none of them).
    assert [sorted(kids) for _, kids in got] == [[], [6, 8], []]


def test_stopping_points_include_the_root_and_respect_k():
    empty = _tree([], [], [])
    # An empty tree can only end at the root, which has no children.
    assert stopping_points(empty, 4) == [((), frozenset())]
    assert stopping_points(T, 0) == []
    # Ties go to the earlier node (the root before 9, both .05).
    assert [p for p, _ in stopping_points(T, 6)][-2:] == [(), (9,)]


def test_subtree_rerooted_under_a_root_child():
    s = subtree(T, 5)
    assert s is not None
    # Everything below 5, with 6 and 8 now at the root and 7 under 6.
    assert s.tokens.tolist() == [6, 7, 8] and s.parents.tolist() == [-1, 0, -1]
    assert s.scores.tolist() == pytest.approx([0.5, 0.4, 0.15])
    # A leaf child yields an empty tree; a token that is not a root child yields nothing.
    leaf = subtree(T, 9)
    assert leaf is not None and len(leaf) == 0
    assert subtree(T, 6) is None


def test_select_needs_both_the_accepted_path_and_the_bonus():
    ahead = {(5,): T, (): _tree([1], [-1], [0.5])}
    # Accepted "5", bonus 5: the tree drafted after "5", under its root child 5.
    hit = select(ahead, [5, 5])
    assert hit is not None and hit.tokens.tolist() == [6, 7, 8]
    # Nothing accepted, bonus 1: a leaf, so an empty tree (still a hit: no wait).
    assert select(ahead, [1]) is not None
    # A bonus the tree did not draft, an accepted path nothing was drafted for, no tokens: misses.
    assert select(ahead, [5, 3]) is None
    assert select(ahead, [7, 5]) is None
    assert select(ahead, []) is None


# -- the drafter -------------------------------------------------------------------------------

NS = Namespace(name="t", vocab_size=100)
PARAMS = DraftParams(budget=16, max_depth=8)


def test_drafting_ahead_leaves_the_session_as_it_was():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open(_a([1, 2, 3, 4, 1, 2, 3, 5, 1, 2]))
    tree = d.draft(s, PARAMS)
    before = (s.context.tokens.copy(), s.hints, s.last_tree)
    ahead = d.prespeculate(s, 3, PARAMS)
    assert ahead and len(ahead) <= 3
    # Same context, hints and current tree; only the trees drafted ahead are remembered.
    assert s.context.tokens.tolist() == before[0].tolist() and s.hints == before[1]
    kept = s.last_tree
    assert kept is not None and s.prefetched is ahead
    for name in ("tokens", "parents", "sources", "scores"):  # the session keeps a copy of its tree
        assert getattr(kept, name).tolist() == getattr(tree, name).tolist(), name


def test_tree_drafted_ahead_excludes_the_stopping_nodes_children():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open(_a([1, 2, 3, 4, 1, 2, 3, 5, 1, 2]))
    tree = d.draft(s, PARAMS)
    d.prespeculate(s, 4, PARAMS)
    assert any(kids for _, kids in stopping_points(tree, 4))  # the exclusion is exercised
    for path, kids in stopping_points(tree, 4):
        ahead = s.prefetched[path]
        roots = set(ahead.tokens[ahead.parents == -1].tolist())
        assert not roots & kids


def test_accept_goes_on_with_the_tree_drafted_ahead():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open(_a([7, 8, 9, 7, 8, 9, 7, 8, 9, 7]))
    d.draft(s, PARAMS)  # "8 9 7 8 ..." from the repetition
    d.prespeculate(s, 4, PARAMS)
    (path, _), *_ = stopping_points(s.last_tree, 1)
    ahead = s.prefetched[path]
    bonus = int(ahead.tokens[ahead.parents == -1][0])
    d.accept(s, _a([*path, bonus]))
    # The next tree is the subtree under the bonus token of the tree drafted ahead.
    assert s.last_tree is not None
    assert s.last_tree.tokens.tolist() == subtree(ahead, bonus).tokens.tolist()
    # An outcome nothing was drafted ahead for leaves no current tree (a fresh draft follows).
    d.draft(s, PARAMS)
    d.prespeculate(s, 1, PARAMS)
    d.accept(s, _a([99, 98]))
    assert s.last_tree is None and s.prefetched == {}


def test_lookahead_out_of_range():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open(_a([1, 2, 1]))
    d.draft(s, PARAMS)
    with pytest.raises(ValueError, match="lookahead"):
        d.prespeculate(s, 17, PARAMS)


# -- compiled stopping points and subtrees against plain references -------------------------------


def _reference_points(tree, k):
    """Stopping points computed plainly: every node's chance of ending there, sorted."""
    n = len(tree)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    score = [1.0, *tree.scores.astype(np.float64).tolist()]
    ends = score.copy()
    children = [set() for _ in range(n + 1)]
    for i, p in enumerate(parents):
        ends[p + 1] -= score[i + 1]
        children[p + 1].add(tokens[i])
    out = []
    for slot in sorted(range(n + 1), key=lambda s: (-ends[s], s))[: max(k, 0)]:
        path, node = [], slot - 1
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        out.append((tuple(reversed(path)), frozenset(children[slot])))
    return out


def _random_tree(rng, n):
    """A tree of ``n`` nodes, parents first, children of a node with distinct tokens and scores
    never above their parent's (some of them tied)."""
    tokens, parents, scores = [], [], []
    for i in range(n):
        p = int(rng.integers(-1, i)) if i else -1
        taken = {tokens[j] for j in range(i) if parents[j] == p}
        t = int(rng.choice([x for x in range(12) if x not in taken])) if len(taken) < 12 else None
        if t is None:
            break
        top = 1.0 if p < 0 else scores[p]
        scores.append(float(np.float32(top * rng.choice([1.0, 0.5, rng.random()]))))
        tokens.append(t)
        parents.append(p)
    return _tree(tokens, parents, scores)


def test_compiled_stopping_points_and_subtrees_match_references():
    rng = np.random.default_rng(7)
    for _ in range(300):
        tree = _random_tree(rng, int(rng.integers(0, 40)))
        for k in (0, 1, 3, 16):
            assert stopping_points(tree, k) == _reference_points(tree, k)
        for token in range(12):
            got = subtree(tree, token)
            roots = np.flatnonzero((tree.parents == -1) & (tree.tokens == token))
            if roots.size == 0:
                assert got is None
                continue
            # Below the root child: its descendants, re-rooted, in order.
            inside = {int(roots[0])}
            kept = []
            for i, p in enumerate(tree.parents.tolist()):
                if p in inside:
                    inside.add(i)
                    kept.append(i)
            assert got is not None and got.tokens.tolist() == tree.tokens[kept].tolist()
            assert got.scores.tolist() == tree.scores[kept].tolist()
            new_at = {old: new for new, old in enumerate(kept)}
            want = [-1 if p == roots[0] else new_at[p] for p in tree.parents[kept].tolist()]
            assert got.parents.tolist() == want


def test_compiled_outcomes_and_fans_match_references():
    rng = np.random.default_rng(11)
    for _ in range(300):
        sessions = int(rng.integers(1, 4))
        owner, chances, paths, cands = [], [], [], []
        for j in range(sessions):
            for _ in range(int(rng.integers(0, 4))):
                owner.append(j)
                chances.append(float(rng.choice([0.5, 0.25, rng.random()])))
                paths.append([int(x) for x in rng.integers(0, 50, int(rng.integers(0, 5)))])
                n = int(rng.integers(0, 6))
                tokens = rng.choice(50, n, replace=False).tolist()
                scores = [float(np.float32(rng.choice([0.5, 0.25, rng.random()]))) for _ in range(n)]
                cands.append(list(zip(tokens, scores, strict=True)))
        keep = rng.integers(0, 9, sessions)
        # Plainly: per session every candidate's chance, the likeliest kept (ties: the earlier
        # point, then candidate), each point's best-scoring first.
        chance_of = {}
        for i, cs in enumerate(cands):
            mass = np.float32(sum(np.float32(s) for _, s in cs)) if cs else np.float32(0)
            for r, (_, score) in enumerate(cs):
                chance_of[i, r] = np.float32(chances[i]) * np.float32(score) / max(mass, np.float32(1e-12))
        chosen = set()
        for j in range(sessions):
            mine = sorted(((i, r) for (i, r) in chance_of if owner[i] == j), key=lambda ir: (-chance_of[ir], ir))
            chosen.update(mine[: int(keep[j])])
        want = [
            sorted((r for r in range(len(cs)) if (i, r) in chosen), key=lambda r, cs=cs: -cs[r][1])
            for i, cs in enumerate(cands)
        ]

        flat = [c for cs in cands for c in cs]
        offsets = np.cumsum([0] + [len(cs) for cs in cands])
        batch = TreeBatch(_a([t for t, _ in flat]), np.full(len(flat), -1, np.int32), np.zeros(len(flat), np.uint8),
                          np.array([s for _, s in flat], np.float32), offsets)  # fmt: skip
        path_ends = np.cumsum([len(p) for p in paths], dtype=np.int64)
        out = likeliest_outcomes(np.array(owner, np.int64), np.array(chances), keep,
                                 _a([t for p in paths for t in p]), path_ends, batch)  # fmt: skip
        got = np.split(out.kept, out.kept_ends[:-1]) if owner else []
        assert [(g - offsets[i]).tolist() for i, g in enumerate(got)] == want
        suffixes = [[*paths[i], cands[i][r][0]] for i in range(len(cands)) for r in want[i]]
        assert [x.tolist() for x in np.split(out.suffix_tokens, out.suffix_ends)[:-1]] == suffixes

        # Each point's fan: its kept candidates as root children, each one's chain below it.
        kept = out.kept
        bonus = TreeBatch(batch.tokens[kept], batch.parents[kept], batch.sources[kept], batch.scores[kept],
                          np.concatenate(([0], out.kept_ends)))  # fmt: skip
        lengths = rng.integers(0, 4, kept.size)
        chain_tokens = rng.integers(0, 50, int(lengths.sum())).astype(np.int32)
        chains = TreeBatch(chain_tokens, np.zeros(chain_tokens.size, np.int32), np.ones(chain_tokens.size, np.uint8),
                           rng.random(chain_tokens.size).astype(np.float32), np.cumsum([0, *lengths]))  # fmt: skip
        trees = DraftedTrees(fans(bonus, chains))
        assert len(trees) == len(cands)
        r = 0
        for i, tree in enumerate(trees):
            tokens, parents, scores = [], [], []
            for _ in want[i]:
                tokens.append(int(bonus.tokens[r]))
                parents.append(-1)
                scores.append(float(bonus.scores[r]))
                lo, hi = chains.offsets[r : r + 2]
                for c in range(lo, hi):
                    parents.append(len(tokens) - 1)
                    tokens.append(int(chains.tokens[c]))
                    scores.append(float(chains.scores[c]))
                r += 1
            assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
            assert tree.scores.tolist() == scores


def test_drafting_ahead_for_many_sessions_equals_each_point_drafted_alone():
    prompts = [[1, 2, 3, 4, 1, 2, 3, 5, 1, 2], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7], [4, 4, 5, 4, 4, 5, 4], [3, 1]]
    ks = [3, 1, 0, 4]
    d = NamespaceDrafter(NS, DrafterConfig())
    sessions = [d.open(_a(p)) for p in prompts]
    for s in sessions[:3]:  # the last session has no tree: nothing is drafted ahead for it
        d.draft(s, PARAMS)
    trees = [s.last_tree for s in sessions]
    together = d.prespeculate_many([(s, k, PARAMS) for s, k in zip(sessions, ks, strict=True)])
    assert [len(a) for a in together] == [3, 1, 0, 0]
    depth = PARAMS.max_depth + 1
    for s, k, tree, ahead in zip(sessions, ks, trees, together, strict=True):
        assert s.prefetched is ahead
        points = _reference_points(tree, k) if tree is not None else []
        assert list(ahead) == [path for path, _ in points]  # best first
        for path, kids in points:  # each drafted on its own: the context extended, the children left out
            (alone,) = _drafted_alone(d, s, path, kids, depth)
            for name in ("tokens", "parents", "sources", "scores"):
                assert getattr(ahead[path], name).tolist() == getattr(alone, name).tolist(), name


def _drafted_alone(d, s, path, kids, depth):
    """One tree for the session's context extended by ``path``, its root leaving out ``kids``:
    a one-job table for the compiled step, written column by column."""
    job = np.zeros((1, len(draft_kernel.JOB_COLUMNS)), dtype=np.int64)
    job[0, draft_kernel.ROW] = d.store.hold(s)
    job[0, draft_kernel.SUFFIX_END] = len(path)
    job[0, draft_kernel.EXCLUDE_END] = len(kids)
    job[0, draft_kernel.DEPTH], job[0, draft_kernel.BUDGET] = depth, PARAMS.budget
    job[0, draft_kernel.DEPTH_RESERVE] = PARAMS.depth_reserve
    job[0, draft_kernel.TRACK] = -1  # ranked by score, as the steps drafted ahead are
    return d._step([s], job, np.full(1, PARAMS.min_score), _a(path), _a(sorted(kids)))


# -- chains: drafting ahead for what an engine verifies --------------------------------------------

CHAIN = DraftParams(budget=16, max_depth=8, chain=4)
# Two continuations of "1 2" that the context holds ("3 4" twice, "3 5" once, "6" once).
_CHAIN_PROMPT = [1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3, 5, 7, 1, 2, 6, 1, 2]


def _is_chain(tree):
    return tree.parents.tolist() == list(range(-1, len(tree) - 1))


def _fan_chains(fan):
    """A fan's candidates for the bonus token, each with the chain under it."""
    out = {}
    for root in np.flatnonzero(fan.parents == -1).tolist():
        out[int(fan.tokens[root])] = subtree(fan, int(fan.tokens[root]))
    return out


def test_a_chain_is_drafted_ahead_at_its_own_stopping_points():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open(_a(_CHAIN_PROMPT))
    chain = d.draft(s, CHAIN)
    assert _is_chain(chain) and 0 < len(chain) <= 4
    ahead = d.prespeculate(s, 3, CHAIN)
    lengths, _ = chain_stopping_points(d.chain_calibrator.reach(s.chain.claims, s.chain.track), 3)
    # The points are the chain's own: its first n tokens accepted, best first.
    assert list(ahead) == [tuple(chain.tokens[:n].tolist()) for n in lengths.tolist()]
    for path, fan in ahead.items():
        n = len(path)
        chains = _fan_chains(fan)
        # Every candidate but the token the chain has next (verification stopped before it),
        # each with a chain of at most K tokens after it.
        assert chains and (n == len(chain) or int(chain.tokens[n]) not in chains)
        assert all(c is not None and _is_chain(c) and len(c) <= 4 for c in chains.values())
    # At most AHEAD_CHAINS chains per point on average, the likeliest outcomes.
    assert sum(len(_fan_chains(f)) for f in ahead.values()) <= AHEAD_CHAINS * 3


def test_each_chain_ahead_is_the_one_drafted_after_its_outcome():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open(_a(_CHAIN_PROMPT))
    d.draft(s, CHAIN)
    ahead = d.prespeculate(s, 3, CHAIN)
    checked = 0
    for path, fan in ahead.items():
        for bonus, got in _fan_chains(fan).items():
            want = _chain_drafted_alone(d, s, [*path, bonus])
            for name in ("tokens", "parents", "sources", "scores"):
                assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
            checked += 1
    assert checked >= 2


def test_an_outcome_drafted_ahead_makes_its_chain_the_next_draft():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open(_a(_CHAIN_PROMPT))
    d.draft(s, CHAIN)
    ahead = d.prespeculate(s, 3, CHAIN)
    path, fan = next(iter(ahead.items()))
    bonus, chain = next(iter(_fan_chains(fan).items()))
    trials = d.chain_calibrator.trials
    d.accept(s, _a([*path, bonus]))
    assert s.last_tree is not None and s.last_tree.tokens.tolist() == chain.tokens.tolist()
    # It is held as a chain-mode draft: its outcome teaches the calibrator, and the session
    # drafts ahead of it as of any chain.
    assert s.chain is not None and s.chain.tokens.tolist() == chain.tokens.tolist()
    assert len(s.chain.claims) == len(chain)
    assert set(d.prespeculate(s, 2, CHAIN)) <= {tuple(chain.tokens[:n].tolist()) for n in range(len(chain) + 1)}
    d.accept(s, _a([int(chain.tokens[0]) if len(chain) else 1, 1]))
    assert d.chain_calibrator.trials > trials
    # An outcome nothing was drafted ahead for leaves no draft and no chain (a fresh one follows).
    d.draft(s, CHAIN)
    d.prespeculate(s, 1, CHAIN)
    d.accept(s, _a([99, 98]))
    assert s.last_tree is None and s.chain is None and s.ahead_chains == {}


def test_sessions_of_both_modes_draft_ahead_together():
    d = NamespaceDrafter(NS, DrafterConfig())
    tree_s, chain_s = d.open(_a(_CHAIN_PROMPT)), d.open(_a(_CHAIN_PROMPT))
    d.draft(tree_s, PARAMS)
    d.draft(chain_s, CHAIN)
    trees, chains = d.prespeculate_many([(tree_s, 2, PARAMS), (chain_s, 2, CHAIN)])
    assert list(trees) == [path for path, _ in stopping_points(tree_s.last_tree, 2)]
    assert all(_is_chain(c) for fan in chains.values() for c in _fan_chains(fan).values())
    assert tree_s.ahead_chains == {} and chain_s.ahead_chains


def _chain_drafted_alone(d, s, suffix):
    """The chain the session would draft after its context extended by ``suffix``, nothing
    remembered: a one-job table for the compiled chain step, written column by column."""
    job = np.zeros((1, len(draft_kernel.JOB_COLUMNS)), dtype=np.int64)
    job[0, draft_kernel.ROW] = d.store.hold(s)
    job[0, draft_kernel.SUFFIX_END] = len(suffix)
    job[0, draft_kernel.DEPTH], job[0, draft_kernel.BUDGET] = CHAIN.chain, CHAIN.budget
    job[0, draft_kernel.DEPTH_RESERVE] = CHAIN.depth_reserve
    job[0, draft_kernel.TRACK] = -1
    args = (
        *d._step_args(job, np.full(1, CHAIN.min_score), _a(suffix), _a([])),
        np.array([CHAIN.chain]),
        np.array([CHAIN.chain_min_prob]),
        np.array([s.track]),
        *d.chain_calibrator.reach_args(),
    )
    tokens, parents, sources, scores, _, _, _ = draft_chain_batch(*args)
    return DraftTree(tokens, parents, sources, scores)

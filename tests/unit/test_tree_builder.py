import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import kernels
from indexer.tree_builder import Candidates, DraftTree, MergeJob, Tier, build_tree, merge_candidates, merge_many


def _rows(*rows):
    width = max(len(r) for r in rows)
    return np.array([list(r) + [-1] * (width - len(r)) for r in rows], dtype=np.int32)


def _weighted(tier, rows, weights, confidence=1.0):
    return Candidates(tier, _rows(*rows), weights=np.array(weights, dtype=np.float64), confidence=confidence)


def _probs(tier, rows, probs, confidence=1.0):
    width = max(len(r) for r in rows)
    p = np.array([list(r) + [0.0] * (width - len(r)) for r in probs], dtype=np.float64)
    return Candidates(tier, _rows(*rows), probs=p, confidence=confidence)


def _paths(tree):
    """Every node as its token path from the root (a representation independent of order)."""
    out = []
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        out.append(tuple(reversed(path)))
    return out


# -- Candidates / DraftTree ----------------------------------------------------------------


def test_candidates_need_exactly_one_of_weights_or_probs():
    rows = _rows([1, 2])
    # Neither: the tier's numbers are missing.
    with pytest.raises(ValueError, match="exactly one"):
        Candidates(Tier.CONTEXT, rows)
    # Both: ambiguous.
    with pytest.raises(ValueError, match="exactly one"):
        Candidates(Tier.CONTEXT, rows, weights=np.ones(1), probs=np.ones((1, 2)))


def test_chain_and_depths():
    t = DraftTree.chain(np.array([7, 8, 9], dtype=np.int32), Tier.EXACT)
    # A chain: each node hangs under the previous one.
    assert t.parents.tolist() == [-1, 0, 1]
    assert t.depths().tolist() == [1, 2, 3]
    # All from the given tier, all fully trusted.
    assert t.sources.tolist() == [Tier.EXACT] * 3
    assert t.scores.tolist() == [1.0, 1.0, 1.0]


def test_empty_tree():
    t = DraftTree.empty()
    # No nodes, and accept finds nothing.
    assert len(t) == 0
    assert t.depths().tolist() == []
    assert t.accept(np.array([1, 2], dtype=np.int32)) == []


def test_accept_longest_matching_root_path():
    # 5 -> 6 -> 7 and 5 -> 9; 4 at the root.
    t = DraftTree(
        np.array([5, 4, 6, 9, 7], dtype=np.int32),
        np.array([-1, -1, 0, 0, 2], dtype=np.int32),
        np.zeros(5, dtype=np.uint8),
        np.ones(5, dtype=np.float32),
    )
    # The target follows 5 then 9, then leaves the tree.
    assert t.accept(np.array([5, 9, 1], dtype=np.int32)) == [0, 3]
    # The full chain 5 6 7 is accepted; the extra target token has nowhere to go.
    assert t.accept(np.array([5, 6, 7, 8], dtype=np.int32)) == [0, 2, 4]
    # Another root.
    assert t.accept(np.array([4, 6], dtype=np.int32)) == [1]
    # A first token no root has.
    assert t.accept(np.array([3, 5], dtype=np.int32)) == []
    # Empty target.
    assert t.accept(np.array([], dtype=np.int32)) == []


# -- literal merges --------------------------------------------------------------------------


def test_doctest_merge():
    a = _weighted(Tier.CONTEXT, [[5, 6, 7]], [1.0], confidence=0.9)
    b = _probs(Tier.PRIOR, [[5, 9]], [[0.5, 0.4]])
    t = build_tree([a, b], budget=3, max_depth=3)
    # 5 is shared (0.9 + 0.5, capped at 1); 6 (0.9) and 7 (0.9) beat 9 (0.4).
    assert t.tokens.tolist() == [5, 6, 7]
    assert t.parents.tolist() == [-1, 0, 1]
    assert t.scores.tolist() == pytest.approx([1.0, 0.9, 0.9])


def test_weights_become_shares_of_the_tier():
    c = _weighted(Tier.CONTEXT, [[1, 2], [1, 3]], [3.0, 1.0])
    t = build_tree([c], budget=3, max_depth=2)
    # "1" carries all the weight; "1 2" three quarters; "1 3" one quarter.
    assert t.tokens.tolist() == [1, 2, 3]
    assert t.parents.tolist() == [-1, 0, 0]
    assert t.scores.tolist() == pytest.approx([1.0, 0.75, 0.25])
    assert t.sources.tolist() == [Tier.CONTEXT] * 3


def test_weights_scaled_by_confidence_and_rows_that_ended_keep_their_share():
    c = _weighted(Tier.DYNAMIC, [[1], [-1]], [1.0, 1.0], confidence=0.8)
    t = build_tree([c], budget=4, max_depth=2)
    # Half the weight sits on a row with no tokens, so "1" gets 0.5 x 0.8.
    assert t.tokens.tolist() == [1]
    assert t.scores.tolist() == pytest.approx([0.4])


# Regression: at a46d8c2 a tree built only from probs tiers was always empty (np.bincount over no
# weight cells returned int64, so np.maximum.at truncated every probability to 0).
def test_probs_take_best_row():
    c = _probs(Tier.PRIOR, [[1, 2], [1, 3]], [[0.6, 0.5], [0.4, 0.1]], confidence=0.5)
    t, firsts = merge_candidates([c], budget=3, max_depth=2)
    # "1": max(0.6, 0.4) x 0.5; "1 2": 0.5 x 0.5; "1 3": 0.1 x 0.5.
    assert t.tokens.tolist() == [1, 2, 3]
    assert t.scores.tolist() == pytest.approx([0.3, 0.25, 0.05])
    # The tier's own first guess is "1" at probability 0.6.
    assert firsts[Tier.PRIOR] == (1, pytest.approx(0.6))


def test_probs_take_best_row_beside_a_weighted_tier():
    c = _probs(Tier.PRIOR, [[1, 2], [1, 3]], [[0.6, 0.5], [0.4, 0.1]], confidence=0.5)
    w = _weighted(Tier.CONTEXT, [[9]], [1.0], confidence=0.5)
    t = build_tree([c, w], budget=4, max_depth=2)
    # Depth-major wire order: roots 1 and 9, then 2 and 3 under 1.
    assert t.tokens.tolist() == [1, 9, 2, 3]
    assert t.parents.tolist() == [-1, -1, 0, 0]
    # "1": max(0.6, 0.4) x 0.5; "9": 0.5; "1 2": 0.5 x 0.5; "1 3": 0.1 x 0.5.
    assert t.scores.tolist() == pytest.approx([0.3, 0.5, 0.25, 0.05])
    assert t.sources.tolist() == [Tier.PRIOR, Tier.CONTEXT, Tier.PRIOR, Tier.PRIOR]


def test_tiers_reinforce_and_source_is_strongest_tier():
    a = _weighted(Tier.CONTEXT, [[4]], [1.0], confidence=0.3)
    b = _probs(Tier.PRIOR, [[4]], [[0.5]])
    t = build_tree([a, b], budget=2, max_depth=1)
    # Agreeing tiers add up: 0.3 + 0.5.
    assert t.scores.tolist() == pytest.approx([0.8])
    # The source is the tier contributing most.
    assert t.sources.tolist() == [Tier.PRIOR]


def test_score_is_capped_at_one():
    a = _weighted(Tier.CONTEXT, [[4]], [1.0], confidence=0.9)
    b = _weighted(Tier.LIFETIME_SA, [[4]], [1.0], confidence=0.9)
    # 0.9 + 0.9 is still a probability: capped at 1.
    assert build_tree([a, b], budget=1, max_depth=1).scores.tolist() == [1.0]


def test_budget_keeps_best_nodes():
    c = _weighted(Tier.CONTEXT, [[1, 2], [1, 3]], [3.0, 1.0])
    t = build_tree([c], budget=2, max_depth=2)
    # Two nodes: "1" (1.0) and "1 2" (0.75); "1 3" (0.25) does not fit.
    assert t.tokens.tolist() == [1, 2]


def test_min_score_is_strict():
    c = _weighted(Tier.CONTEXT, [[1, 2], [1, 3]], [3.0, 1.0])
    t = build_tree([c], budget=8, max_depth=2, min_score=0.25)
    # "1 3" scores exactly 0.25, which is not above min_score.
    assert t.tokens.tolist() == [1, 2]


def test_max_depth_truncates_rows():
    c = _weighted(Tier.CONTEXT, [[1, 2, 3, 4]], [1.0])
    t = build_tree([c], budget=8, max_depth=2)
    # Only the first two levels are used.
    assert t.tokens.tolist() == [1, 2]
    assert t.depths().max() == 2


def test_depth_reserve_keeps_best_chain():
    # Weights (total 11.5): "1" 4 (the chain's 1 plus a row ending at "1"), 5: 3, 6: 2.5, 7: 2,
    # while the chain's deeper nodes 2, 3, 4 carry only 1.
    chain = _weighted(Tier.CONTEXT, [[1, 2, 3, 4], [1], [5], [6], [7]], [1.0, 3.0, 3.0, 2.5, 2.0])
    # Without a reserve the four best nodes are the shallow 1, 5, 6, 7.
    assert sorted(build_tree([chain], budget=4, max_depth=4).tokens.tolist()) == [1, 5, 6, 7]
    # Reserving 4 keeps the whole best chain 1 2 3 4 instead.
    t = build_tree([chain], budget=4, max_depth=4, depth_reserve=4)
    assert _paths(t) == [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)]
    # Reserving 2 keeps "1 2" and fills the other two slots with the best rest, 5 and 6.
    t = build_tree([chain], budget=4, max_depth=4, depth_reserve=2)
    assert sorted(_paths(t)) == [(1,), (1, 2), (5,), (6,)]
    # In wire order (depth-major): 1, 5, 6 at the root, then 2 under 1.
    assert (t.tokens.tolist(), t.parents.tolist()) == ([1, 5, 6, 2], [-1, -1, -1, 0])


def test_depth_reserve_never_exceeds_budget():
    chain = _weighted(Tier.CONTEXT, [[1, 2, 3, 4, 5]], [1.0])
    t = build_tree([chain], budget=2, max_depth=5, depth_reserve=5)
    # The reserve is cut to the budget.
    assert t.tokens.tolist() == [1, 2]


def test_depth_reserve_follows_best_child_not_first_child():
    # Scores: 1, 8, 8 = 0.4; 2 = 0.6 (two rows); 9, 9 = 0.2.
    c = _weighted(Tier.CONTEXT, [[1, 8, 8], [2, 9, 9], [2]], [2.0, 1.0, 2.0])
    # Without a reserve: 2 (0.6), then 1 and 8 (0.4).
    assert sorted(_paths(build_tree([c], budget=3, max_depth=3))) == [(1,), (1, 8), (2,)]
    t = build_tree([c], budget=3, max_depth=3, depth_reserve=3)
    # The greedy chain starts from the best root child (2), not the first one (1).
    assert sorted(_paths(t)) == [(2,), (2, 9), (2, 9, 9)]


def test_sibling_tie_goes_to_smaller_token():
    c = _weighted(Tier.CONTEXT, [[9], [3]], [1.0, 1.0])
    # Equal scores: the lexicographically smaller row wins the single slot.
    assert build_tree([c], budget=1, max_depth=1).tokens.tolist() == [3]


@pytest.mark.parametrize("kw", [{"budget": 0, "max_depth": 4}, {"budget": 4, "max_depth": 0}])
def test_zero_budget_or_depth_gives_empty_tree(kw):
    c = _weighted(Tier.CONTEXT, [[1, 2]], [1.0])
    tree, firsts = merge_candidates([c], **kw)
    # Nothing may be drafted; no first guesses either.
    assert len(tree) == 0
    assert firsts == {}


@pytest.mark.parametrize("kw", [{"budget": -1, "max_depth": 4}, {"budget": 4, "max_depth": -1}])
def test_negative_budget_or_depth_rejected(kw):
    # Negative sizes are caller bugs.
    with pytest.raises(ValueError, match="budget"):
        build_tree([], **kw)


def test_no_candidates_or_only_empty_rows():
    # No tiers at all.
    assert len(build_tree([], budget=4, max_depth=4)) == 0
    # A tier whose rows hold no tokens.
    c = _weighted(Tier.CONTEXT, [[-1, -1]], [1.0])
    assert len(build_tree([c], budget=4, max_depth=4)) == 0
    # A tier with no rows.
    empty = Candidates(Tier.CONTEXT, np.zeros((0, 3), dtype=np.int32), weights=np.zeros(0))
    assert len(build_tree([empty], budget=4, max_depth=4)) == 0


def test_first_guesses_per_tier():
    a = _weighted(Tier.CONTEXT, [[5, 6], [5, 7], [8, 9]], [1.0, 1.0, 3.0], confidence=0.5)
    b = _probs(Tier.PRIOR, [[5]], [[0.4]], confidence=0.5)
    _, firsts = merge_candidates([a, b], budget=8, max_depth=2)
    # CONTEXT alone prefers 8 (3 of 5 weight) over 5 (2 of 5), before its confidence.
    assert firsts[Tier.CONTEXT][0] == 8
    assert firsts[Tier.CONTEXT][1] == pytest.approx(0.6)
    # PRIOR alone guesses 5 with probability 0.4.
    assert firsts[Tier.PRIOR][0] == 5
    assert firsts[Tier.PRIOR][1] == pytest.approx(0.4)


def test_first_guess_skipped_for_zero_confidence_tier():
    a = _weighted(Tier.CONTEXT, [[5]], [1.0], confidence=0.0)
    b = _weighted(Tier.DYNAMIC, [[6]], [1.0], confidence=0.5)
    _, firsts = merge_candidates([a, b], budget=8, max_depth=1)
    # A tier with no confidence cannot be calibrated on its guess.
    assert Tier.CONTEXT not in firsts
    assert firsts[Tier.DYNAMIC] == (6, pytest.approx(1.0))


# -- property tests --------------------------------------------------------------------------


@st.composite
def candidate_sets(draw):
    tiers = draw(st.lists(st.sampled_from(list(Tier)), min_size=1, max_size=3, unique=True))
    parts = []
    for tier in tiers:
        width = draw(st.integers(1, 6))
        n = draw(st.integers(1, 5))
        rows = np.full((n, width), -1, dtype=np.int32)
        lengths = []
        for r in range(n):
            length = draw(st.integers(0, width))
            rows[r, :length] = draw(st.lists(st.integers(0, 3), min_size=length, max_size=length))
            lengths.append(length)
        conf = draw(st.just(0.0) | st.floats(0.01, 1.0))
        if draw(st.booleans()):
            weights = np.array(draw(st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n)))
            parts.append(Candidates(tier, rows, weights=weights, confidence=conf))
        else:
            # Prefix probabilities never grow along a row (as frozen tables produce them).
            probs = np.zeros((n, width))
            for r in range(n):
                p = 1.0
                for j in range(lengths[r]):
                    p *= draw(st.floats(0.05, 1.0))
                    probs[r, j] = p
            parts.append(Candidates(tier, rows, probs=probs, confidence=conf))
    return parts


def _row_prefixes(parts, max_depth):
    out = set()
    for c in parts:
        for row in c.rows.tolist():
            toks = [t for t in row[:max_depth] if t >= 0]
            out.update(tuple(toks[: k + 1]) for k in range(len(toks)))
    return out


@settings(max_examples=200, deadline=None)
@given(
    parts=candidate_sets(),
    budget=st.integers(0, 12),
    max_depth=st.integers(0, 7),
    min_score=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
    depth_reserve=st.integers(0, 8),
)
def test_tree_invariants(parts, budget, max_depth, min_score, depth_reserve):
    kw = {"budget": budget, "max_depth": max_depth, "min_score": min_score, "depth_reserve": depth_reserve}
    tree, _ = merge_candidates(parts, **kw)
    n = len(tree)
    # Never over budget, never deeper than max_depth.
    assert n <= budget
    if n:
        assert tree.depths().max() <= max_depth
    # Wire order: every parent precedes its children.
    assert all(-1 <= p < i for i, p in enumerate(tree.parents.tolist()))
    # Siblings carry distinct tokens (so acceptance is unambiguous).
    pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))
    assert len(set(pairs)) == n
    # Scores never grow from parent to child, and all are above min_score.
    for i, p in enumerate(tree.parents.tolist()):
        assert tree.scores[i] > min_score
        if p >= 0:
            assert tree.scores[i] <= tree.scores[p]
    # Every node is a prefix of some candidate row (within max_depth).
    assert set(_paths(tree)) <= _row_prefixes(parts, max_depth)
    # Deterministic: the same input gives identical arrays.
    again, _ = merge_candidates(parts, **kw)
    for name in ("tokens", "parents", "sources", "scores"):
        assert np.array_equal(getattr(tree, name), getattr(again, name))
    # The dtypes the wire format relies on.
    assert (tree.tokens.dtype, tree.parents.dtype, tree.sources.dtype) == (np.int32, np.int32, np.uint8)


@settings(max_examples=150, deadline=None)
@given(parts=candidate_sets(), budget=st.integers(1, 12), max_depth=st.integers(1, 7))
def test_budget_keeps_highest_scores(parts, budget, max_depth):
    everything = build_tree(parts, budget=10_000, max_depth=max_depth)
    tree = build_tree(parts, budget=budget, max_depth=max_depth)
    # Without a reserve the kept nodes are the `budget` best ones.
    want = sorted(everything.scores.tolist(), reverse=True)[:budget]
    assert sorted(tree.scores.tolist(), reverse=True) == pytest.approx(want)
    # And a smaller budget keeps a subset of a larger one's nodes.
    assert set(_paths(tree)) <= set(_paths(everything))


@settings(max_examples=150, deadline=None)
@given(parts=candidate_sets(), budget=st.integers(1, 12), depth_reserve=st.integers(1, 6))
def test_depth_reserve_keeps_greedy_best_chain(parts, budget, depth_reserve):
    everything = build_tree(parts, budget=10_000, max_depth=6)
    paths = _paths(everything)
    # The greedy chain: from the root, repeatedly the best-scoring child. Scores come back as
    # float32, so stop at the first step where two children are (nearly) tied.
    chain, node = [], -1
    while len(chain) < min(depth_reserve, budget):
        kids = [i for i, p in enumerate(everything.parents.tolist()) if p == node]
        if not kids:
            break
        best = max(everything.scores[i] for i in kids)
        top = [i for i in kids if everything.scores[i] >= best - 1e-6]
        if len(top) > 1:
            break
        node = top[0]
        chain.append(paths[node])
    tree = build_tree(parts, budget=budget, max_depth=6, depth_reserve=depth_reserve)
    # The reserved chain always survives, however wide the alternatives.
    assert set(chain) <= set(_paths(tree))
    assert len(tree) <= budget


def _score_reference(parts, max_depth):
    """Per token path: (score, source) from a plain dict trie, the definition the kernel follows."""
    per: dict[tuple[int, ...], dict[int, float]] = {}
    for c in parts:
        total = float(c.weights.sum()) if c.weights is not None else 0.0
        for r, row in enumerate(c.rows.tolist()):
            toks = [t for t in row[:max_depth] if t >= 0]
            for d in range(len(toks)):
                cell = per.setdefault(tuple(toks[: d + 1]), {})
                if c.probs is not None:
                    cell[int(c.tier)] = max(cell.get(int(c.tier), 0.0), float(c.probs[r, d]) * c.confidence)
                elif total > 0:
                    cell[int(c.tier)] = cell.get(int(c.tier), 0.0) + float(c.weights[r]) * c.confidence / total
    out = {}
    for path, cell in per.items():
        score = min(sum(cell.values()), 1.0)
        if score > 0:
            # The strongest tier, ties to the lower one; tiers within rounding of the best
            # (the kernel scales a weight by confidence / total, here weight * confidence /
            # total) may go either way.
            best = max(cell.values())
            out[path] = (score, sorted(t for t, v in cell.items() if v >= best * (1 - 1e-9)))
    return out


@settings(max_examples=300, deadline=None)
@given(parts=candidate_sets(), max_depth=st.integers(1, 7))
def test_node_scores_and_sources_match_a_plain_trie(parts, max_depth):
    tree = build_tree(parts, budget=10_000, max_depth=max_depth)
    expected = _score_reference(parts, max_depth)
    got = {p: (float(s), int(src)) for p, s, src in zip(_paths(tree), tree.scores, tree.sources, strict=True)}
    assert got.keys() == expected.keys()
    for path, (score, source) in expected.items():  # source: the tiers it may be
        assert got[path][0] == pytest.approx(score, rel=1e-5, abs=1e-6)
        assert got[path][1] in source


def _stack_reference(parts, depth):
    """Every part's rows in one -1 padded block with per-cell values, built with plain numpy."""
    total = sum(c.rows.shape[0] for c in parts)
    rows = np.full((total, depth), -1, dtype=np.int32)
    vals = np.zeros((total, depth))
    is_max = np.zeros(total, dtype=bool)
    tiers = np.empty(total, dtype=np.int64)
    at = 0
    for c in parts:
        k, w = c.rows.shape[0], min(c.rows.shape[1], depth)
        rows[at : at + k, :w] = c.rows[:, :w]
        tiers[at : at + k] = int(c.tier)
        if c.probs is not None:
            vals[at : at + k, :w] = c.probs[:, :w] * c.confidence
            is_max[at : at + k] = True
        elif c.weights.sum() > 0:
            vals[at : at + k] = (c.weights * (c.confidence / c.weights.sum()))[:, None]
        at += k
    return rows, vals, is_max, tiers


@settings(max_examples=200, deadline=None)
@given(parts=candidate_sets(), budget=st.integers(1, 12), max_depth=st.integers(1, 7))
def test_merge_equals_stacking_then_merging(parts, budget, max_depth):
    # The one-call kernel (flattened parts) builds exactly the tree of stacking then merging.
    rows, vals, is_max, tiers = _stack_reference(parts, max_depth)
    expected = kernels.merge_tree(rows, vals, is_max, tiers, len(Tier), budget, 0.0, 2, kernels.no_calibration())
    got = merge_candidates(parts, budget=budget, max_depth=max_depth, depth_reserve=2)[0]
    assert got.tokens.tolist() == expected[0].tolist()
    assert got.parents.tolist() == expected[1].tolist()
    assert got.sources.tolist() == expected[2].tolist()
    assert np.allclose(got.scores, expected[3])


@settings(max_examples=100, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.one_of(st.just([]), candidate_sets()),
            st.integers(0, 12),
            st.integers(0, 7),
            st.sampled_from([0.0, 0.05, 0.3]),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_merge_many_gives_each_job_its_own_tree(jobs):
    # A batch merged in one call: each tree is the one its own parts and limits make, whatever
    # the other jobs hold (empty ones, zero budgets or depths included).
    got = merge_many([MergeJob(parts, b, d, m, r) for parts, b, d, m, r in jobs])
    assert len(got) == len(jobs)
    for (tree, firsts), (parts, budget, depth, min_score, reserve) in zip(got, jobs, strict=True):
        kept = [c for c in parts if c.rows.size]
        if not kept or budget == 0 or depth == 0:
            assert len(tree) == 0 and firsts == {}
            continue
        rows, vals, is_max, tiers = _stack_reference(kept, depth)
        expected = kernels.merge_tree(
            rows, vals, is_max, tiers, len(Tier), budget, min_score, reserve, kernels.no_calibration()
        )
        assert tree.tokens.tolist() == expected[0].tolist()
        assert tree.parents.tolist() == expected[1].tolist()
        assert tree.sources.tolist() == expected[2].tolist()
        assert np.allclose(tree.scores, expected[3])
        for tier, (token, _) in firsts.items():
            assert token == expected[4][tier]
    with pytest.raises(ValueError):
        merge_many([MergeJob([], -1, 2)])


def test_rejected_branches_best_children_extended_by_best_descendants():
    # Tree: 5 -> {7 -> 9, 8}; scores 7 (.5) > 8 (.4), so 7's branch comes first, extended by 9.
    tokens = np.array([5, 7, 8, 9], dtype=np.int32)
    parents = np.array([-1, 0, 0, 1], dtype=np.int32)
    scores = np.array([0.9, 0.5, 0.4, 0.3], dtype=np.float32)
    rows, lengths = kernels.rejected_branches(tokens, parents, scores, 0, 4)
    assert rows.tolist() == [[7, 9], [8, -1]]
    assert lengths.tolist() == [2, 1]
    # The limit keeps the best: one branch only.
    assert kernels.rejected_branches(tokens, parents, scores, 0, 1)[0].tolist() == [[7, 9]]
    # From the root (-1) the only child is 5, extended along the best path 7 -> 9.
    assert kernels.rejected_branches(tokens, parents, scores, -1, 4)[0].tolist() == [[5, 7, 9]]
    # A leaf has no children: nothing.
    assert kernels.rejected_branches(tokens, parents, scores, 3, 4)[0].shape == (0, 0)


def test_verification_outcome_is_the_path_and_the_branches_left_where_it_stopped():
    # Tree: 5 -> {7 -> 9, 8}. The target produced 5 then 6: the path is node 0 (5), and
    # verification left the tree under it, rejecting 7 -> 9 and 8 (best first).
    tokens = np.array([5, 7, 8, 9], dtype=np.int32)
    parents = np.array([-1, 0, 0, 1], dtype=np.int32)
    scores = np.array([0.9, 0.5, 0.4, 0.3], dtype=np.float32)
    path, rows, lengths = kernels.verification_outcome(tokens, parents, scores, np.array([5, 6], np.int32), 4)
    assert path.tolist() == [0]
    assert rows.tolist() == [[7, 9], [8, -1]] and lengths.tolist() == [2, 1]
    # Nothing matched: every root child was rejected.
    path, rows, _ = kernels.verification_outcome(tokens, parents, scores, np.array([3], np.int32), 4)
    assert path.tolist() == [] and rows.tolist() == [[5, 7, 9]]
    # Verification ended inside the tree (every produced token on the path): nothing rejected.
    path, rows, lengths = kernels.verification_outcome(tokens, parents, scores, np.array([5, 7], np.int32), 4)
    assert path.tolist() == [0, 1] and rows.shape == (0, 0) and lengths.size == 0
    # A limit of 0 asks for the path only.
    path, rows, _ = kernels.verification_outcome(tokens, parents, scores, np.array([5, 6], np.int32), 0)
    assert path.tolist() == [0] and rows.shape == (0, 0)


def test_rejected_branch_ties_go_to_lower_node():
    # Equal scores: the lower id first, for both the branch order and the extension.
    tokens = np.array([4, 6, 1, 2], dtype=np.int32)
    parents = np.array([-1, -1, 0, 0], dtype=np.int32)
    scores = np.full(4, 0.5, dtype=np.float32)
    rows, _ = kernels.rejected_branches(tokens, parents, scores, -1, 4)
    assert rows.tolist() == [[4, 1], [6, -1]]

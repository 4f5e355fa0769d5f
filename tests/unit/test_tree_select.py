"""Trees kept by their calibrated chances: from a tree drafted larger than its budget, the nodes
verification most likely reaches, each with its parent, in wire order; the session holds what
was kept."""

import numpy as np
import pytest

from cache_service.admin import options
from indexer import drafter as drafter_module
from indexer.chain import ChainCalibrator
from indexer.drafter import _CALIBRATED_AFTER, DrafterConfig, DraftParams, NamespaceDrafter
from indexer.kernels import chain_reach
from indexer.kernels.tree_select import keep_likeliest, select_batch
from indexer.session_store import SessionStore
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree, Tier

NS = Namespace(name="test", vocab_size=100)


def _tree(tokens, parents, scores, sources):
    ids, up = np.array(tokens, np.int32), np.array(parents, np.int32)
    return DraftTree(ids, up, np.array(sources, np.uint8), np.array(scores, np.float32))


def _select(tree: DraftTree, budget: int, cal: ChainCalibrator, track: int = 0) -> DraftTree:
    store = SessionStore()
    out = select_batch(
        tree.tokens, tree.parents, tree.sources, tree.scores, np.array([0, len(tree)], np.int64),
        np.array([budget], np.int64), np.array([track], np.int64), np.array([-1], np.int64), store.i32, store.i64,
        *cal.select_args(),
    )  # fmt: skip
    return DraftTree(*out[:4])


# Two branches: the context's (scored higher) and the prior's. The calibrator learns that the
# prior's nodes are what the target accepts and the context's never are.
C, P = int(Tier.CONTEXT), int(Tier.PRIOR)
T = _tree([5, 6, 7, 8, 9, 10], [-1, 0, 1, -1, 3, 4], [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [C, C, C, P, P, P])


def _taught() -> ChainCalibrator:
    cal = ChainCalibrator()
    for _ in range(200):
        cal.update(T, np.array([8, 9, 10, 11], np.int32))
    return cal


def test_the_budgets_likeliest_nodes_are_kept_not_the_highest_scores():
    cal = _taught()
    kept = _select(T, 3, cal)
    # By score the context's branch would stay; by calibrated reach the prior's does.
    assert kept.tokens.tolist() == [8, 9, 10]
    assert kept.parents.tolist() == [-1, 0, 1]
    assert kept.scores.tolist() == pytest.approx([0.6, 0.5, 0.4])  # the scores as drafted
    reach = chain_reach(T.parents, cal.conditional(T))
    assert keep_likeliest(T.parents, reach, 3).tolist() == [3, 4, 5]


def test_a_tree_within_its_budget_or_asked_whole_is_kept_as_it_is():
    cal = _taught()
    for budget in (6, 10, -1):
        kept = _select(T, budget, cal)
        assert kept.tokens.tolist() == T.tokens.tolist() and kept.parents.tolist() == T.parents.tolist()


def test_a_node_is_never_kept_without_its_parent():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)], np.int64)
        reach = rng.random(n)  # not monotone: the guard, not the ranking, keeps the tree whole
        budget = int(rng.integers(1, n + 1))
        kept = keep_likeliest(parents, reach, budget)
        assert kept.size <= budget and np.all(np.diff(kept) > 0)
        chosen = set(kept.tolist())
        assert all(parents[i] < 0 or int(parents[i]) in chosen for i in chosen)


def _prompt() -> list[int]:
    # "1 2" followed by many different tokens: a wide tree after a context ending "1 2".
    return [t for k in range(30) for t in (1, 2, 10 + k)] + [1, 2]


def _teach(d: NamespaceDrafter) -> None:
    wide = _tree(list(range(10, 70)), [-1] * 60, [0.5] * 60, [C] * 60)
    while d.chain_calibrator.trials < _CALIBRATED_AFTER:
        d.chain_calibrator.update(wide, np.array([10], np.int32))


def test_a_calibrated_namespace_drafts_its_pool_and_the_session_holds_the_tree_kept():
    d = NamespaceDrafter(NS, DrafterConfig(tree_pool=3))
    _teach(d)
    s = d.open(_prompt())
    tree = d.draft(s, DraftParams(budget=8))
    assert len(tree) == 8
    held = s.last_tree
    assert held is not None and held.tokens.tolist() == tree.tokens.tolist()
    assert held.parents.tolist() == tree.parents.tolist()
    d.accept(s, np.array([10], np.int32))  # the outcome of the tree kept is learnt


def test_before_the_calibrator_has_learnt_enough_trees_are_the_merges():
    pooled, plain = NamespaceDrafter(NS, DrafterConfig(tree_pool=3)), NamespaceDrafter(NS, DrafterConfig(tree_pool=1))
    a, b = pooled.open(_prompt()), plain.open(_prompt())
    ta, tb = pooled.draft(a, DraftParams(budget=8)), plain.draft(b, DraftParams(budget=8))
    assert ta.tokens.tolist() == tb.tokens.tolist() and ta.parents.tolist() == tb.parents.tolist()
    # And tree-mode outcomes teach the calibrator the trees will be kept by.
    pooled.accept(a, np.array([10], np.int32))
    assert pooled.chain_calibrator.trials > 0


def test_the_tree_pool_is_checked_and_the_command_lines_agree_with_the_drafter():
    for bad in (0, drafter_module.MAX_TREE_POOL + 1):
        with pytest.raises(ValueError):
            DrafterConfig(tree_pool=bad)
    assert DrafterConfig().tree_pool == options.TREE_POOL
    assert options.MAX_TREE_POOL == drafter_module.MAX_TREE_POOL


def test_a_threaded_step_keeps_the_trees_one_thread_keeps():
    import numba

    def drafted(threads: int) -> tuple[NamespaceDrafter, list, list]:
        d = NamespaceDrafter(NS, DrafterConfig(threads=threads, tree_pool=3))
        _teach(d)
        sessions = [d.open([t for k in range(30) for t in (1, 2, 10 + (k * (j + 1)) % 60)] + [1, 2]) for j in range(8)]
        return d, sessions, d.draft_many([(s, DraftParams(budget=8)) for s in sessions])

    threaded, sessions, shared = drafted(2)
    assert threaded.threads == (2 if numba.threading_layer() in ("omp", "tbb") else 1)
    _, _, alone = drafted(1)
    for a, b, s in zip(alone, shared, sessions, strict=True):
        assert len(b) == 8 and a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        held = s.last_tree
        assert held is not None and held.tokens.tolist() == b.tokens.tolist()

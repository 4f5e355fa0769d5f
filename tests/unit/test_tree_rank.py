"""Trees ranked by their calibrated chances: the merge keeps the budget's nodes verification
most likely reaches (the products of the chain calibrator's conditionals along their paths),
each with its parent, in wire order; the session holds what was kept."""

import numpy as np
import pytest

from cache_service.admin import options
from indexer import drafter as drafter_module
from indexer.chain import ChainCalibrator
from indexer.drafter import _CALIBRATED_AFTER, DrafterConfig, DraftParams, NamespaceDrafter
from indexer.kernels import chain_backoff, chain_cells, chain_conditional, chain_reach, merge_tree, no_calibration
from indexer.kernels.chain import DEPTHS, RANKS, RATIO_BINS, TRACKS
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree, Tier

NS = Namespace(name="test", vocab_size=100)
C, P = int(Tier.CONTEXT), int(Tier.PRIOR)
N_TIERS = len(Tier)


def _tree(tokens, parents, scores, sources):
    ids, up = np.array(tokens, np.int32), np.array(parents, np.int32)
    return DraftTree(ids, up, np.array(sources, np.uint8), np.array(scores, np.float32))


def _calibration(cal: ChainCalibrator, track: int = 0) -> tuple:
    edges, hits, trials, coarse_hits, coarse_trials, claim, coarse_prior, fine_prior = cal.cell_args()
    return track, edges, hits, trials, chain_backoff(coarse_hits, coarse_trials, claim, coarse_prior), fine_prior


def _merge(rows, vals, tiers, budget: int, calibration: tuple) -> DraftTree:
    rows = np.array(rows, np.int32)
    out = merge_tree(
        rows, np.array(vals, np.float64), np.ones(rows.shape[0], np.bool_), np.array(tiers, np.int64), N_TIERS,
        budget, 0.0, 0, calibration,
    )  # fmt: skip
    return DraftTree(*out[:4])


# Two branches: the context's (scored higher) and the prior's. The calibrator learns that the
# prior's nodes are what the target accepts and the context's never are.
ROWS, VALS, TIERS = [[5, 6, 7], [8, 9, 10]], [[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]], [C, P]
T = _tree([5, 8, 6, 9, 7, 10], [-1, -1, 0, 1, 2, 3], [0.9, 0.6, 0.8, 0.5, 0.7, 0.4], [C, P, C, P, C, P])


def _taught() -> ChainCalibrator:
    cal = ChainCalibrator()
    for _ in range(200):
        cal.update(T, np.array([8, 9, 10, 11], np.int32))
    return cal


def test_the_budgets_likeliest_nodes_are_kept_not_the_highest_scores():
    cal = _taught()
    assert _merge(ROWS, VALS, TIERS, 6, no_calibration()).tokens.tolist() == T.tokens.tolist()  # the whole trie
    by_score = _merge(ROWS, VALS, TIERS, 3, no_calibration())
    assert by_score.tokens.tolist() == [5, 6, 7]
    kept = _merge(ROWS, VALS, TIERS, 3, _calibration(cal))
    assert kept.tokens.tolist() == [8, 9, 10] and kept.parents.tolist() == [-1, 0, 1]
    assert kept.scores.tolist() == pytest.approx([0.6, 0.5, 0.4])  # the scores as merged


def _reference(tree: DraftTree, calibration: tuple, budget: int) -> list[int]:
    """The ``budget`` nodes of the whole trie with the largest reach, ties to the earlier."""
    track, edges, hits, trials, coarse, fine_prior = calibration
    cells = chain_cells(tree.parents, tree.scores, tree.sources, edges, track)
    reach = chain_reach(tree.parents, np.minimum(chain_conditional(cells, hits, trials, coarse, fine_prior), 1.0))
    order = sorted(range(len(tree)), key=lambda i: (-reach[i], i))[:budget]
    return sorted(order)


def test_the_merge_keeps_exactly_the_whole_tries_likeliest_nodes():
    # Pruning by reach while the trie is built loses nothing: the tree kept is the budget's
    # likeliest nodes of the whole trie, each with its parent, whatever the calibration says.
    rng = np.random.default_rng(7)
    shape = (RATIO_BINS, 7, N_TIERS, DEPTHS, TRACKS, RANKS)
    for _ in range(150):
        trials = rng.integers(0, 30, shape).astype(np.float64)
        hits = np.floor(trials * rng.random(shape))
        coarse = rng.random((RATIO_BINS, TRACKS))
        calibration = (int(rng.integers(0, TRACKS)), np.array([0.05, 0.1, 0.2, 0.4, 0.7, 0.99]), hits, trials, coarse,
                       4.0)  # fmt: skip
        n_rows, depth = int(rng.integers(1, 12)), int(rng.integers(1, 6))
        rows = rng.integers(0, 3, (n_rows, depth)).astype(np.int32)
        vals = np.sort(rng.uniform(0.01, 1.0, (n_rows, depth)), axis=1)[:, ::-1].copy()
        tiers = rng.integers(0, N_TIERS, n_rows)
        whole = _merge(rows, vals, tiers, n_rows * depth, no_calibration())
        budget = int(rng.integers(1, len(whole) + 2))
        kept = _merge(rows, vals, tiers, budget, calibration)
        expected = _reference(whole, calibration, budget)
        assert kept.tokens.tolist() == whole.tokens[expected].tolist()
        remap = {old: new for new, old in enumerate(expected)}
        assert kept.parents.tolist() == [remap[int(whole.parents[i])] if whole.parents[i] >= 0 else -1
                                         for i in expected]  # fmt: skip


def _prompt() -> list[int]:
    # "1 2" followed by many different tokens: a wide tree after a context ending "1 2".
    return [t for k in range(30) for t in (1, 2, 10 + k)] + [1, 2]


def _teach(d: NamespaceDrafter) -> None:
    # Of the root children after "1 2", the lowest-scoring (the oldest continuation) is the one accepted.
    wide = _tree(list(range(10, 70)), [-1] * 60, [0.5] * 60, [C] * 60)
    while d.chain_calibrator.trials < _CALIBRATED_AFTER:
        d.chain_calibrator.update(wide, np.array([10], np.int32))


def test_a_calibrated_namespace_ranks_its_trees_and_the_session_holds_the_tree_kept():
    d = NamespaceDrafter(NS, DrafterConfig())
    _teach(d)
    s = d.open(_prompt())
    tree = d.draft(s, DraftParams(budget=8))
    assert len(tree) == 8
    held = s.last_tree
    assert held is not None and held.tokens.tolist() == tree.tokens.tolist()
    assert held.parents.tolist() == tree.parents.tolist()
    d.accept(s, np.array([10], np.int32))  # the outcome of the tree kept is learnt


def test_ranked_by_score_or_before_the_calibrator_has_learnt_enough_trees_are_the_scores():
    ranked, scored = NamespaceDrafter(NS, DrafterConfig()), NamespaceDrafter(NS, DrafterConfig(tree_rank="score"))
    a, b = ranked.open(_prompt()), scored.open(_prompt())
    ta, tb = ranked.draft(a, DraftParams(budget=8)), scored.draft(b, DraftParams(budget=8))
    assert ta.tokens.tolist() == tb.tokens.tolist() and ta.parents.tolist() == tb.parents.tolist()
    # And tree-mode outcomes teach the calibrator the trees will be ranked by.
    ranked.accept(a, np.array([10], np.int32))
    assert ranked.chain_calibrator.trials > 0


def test_the_tree_rank_is_checked_and_the_command_lines_agree_with_the_drafter():
    with pytest.raises(ValueError):
        DrafterConfig(tree_rank="pool")
    assert DrafterConfig().tree_rank == options.TREE_RANK
    assert options.TREE_RANKS == drafter_module.TREE_RANKS


def test_a_threaded_step_ranks_the_trees_one_thread_ranks():
    import numba

    def drafted(threads: int) -> tuple[NamespaceDrafter, list, list]:
        d = NamespaceDrafter(NS, DrafterConfig(threads=threads))
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

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.chain import TRACKS, ChainCalibrator, best_path, chain_of, cut_to_chain, track_of
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter, _batch_of
from indexer.session import Session
from indexer.tokens import Namespace
from indexer.tree_builder import DraftTree, Tier


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _tree(tokens, parents, scores, sources=None):
    n = len(tokens)
    src = np.zeros(n, np.uint8) if sources is None else np.array(sources, np.uint8)
    return DraftTree(_a(tokens), _a(parents), src, np.array(scores, np.float32))


# -- best_path -----------------------------------------------------------------------------------


def test_path_with_larger_expected_length_beats_best_first_child():
    # Root 0 (0.6) has one weak child (0.3); root 1 (0.5) leads a strong chain (0.9, 0.9).
    parents = _a([-1, -1, 0, 1, 3])
    conditional = np.array([0.6, 0.5, 0.3, 0.9, 0.9])
    # Via 1: 0.5 + 0.45 + 0.405 = 1.355 expected tokens; via 0: 0.6 + 0.18 = 0.78.
    assert best_path(parents, conditional, 3).tolist() == [1, 3, 4]


def test_chain_length_limits_what_the_path_may_gain():
    parents = _a([-1, -1, 0, 1, 3])
    conditional = np.array([0.6, 0.5, 0.3, 0.9, 0.9])
    # With two tokens: via 1, 0.5 + 0.45 = 0.95 still beats 0.6 + 0.18 = 0.78.
    assert best_path(parents, conditional, 2).tolist() == [1, 3]
    # With one token the likelier root wins.
    assert best_path(parents, conditional, 1).tolist() == [0]


def test_min_prob_ends_the_chain_at_an_unlikely_token():
    parents = _a([-1, 0, 1])
    conditional = np.array([0.8, 0.5, 0.5])
    # Cumulative probabilities 0.8, 0.4, 0.2: a cut at 0.3 drops the third token.
    assert best_path(parents, conditional, 8, min_prob=0.3).tolist() == [0, 1]
    # A cut above the first token's probability leaves nothing to propose.
    assert best_path(parents, conditional, 8, min_prob=0.9).size == 0


def test_ties_go_to_the_earlier_node():
    # Two roots alike in every way.
    assert best_path(_a([-1, -1]), np.array([0.5, 0.5]), 4).tolist() == [0]


def test_preference_ranks_but_probabilities_cut():
    parents = _a([-1, -1])
    conditional = np.array([0.5, 0.5])
    # The preference picks the second root though the probabilities tie.
    assert best_path(parents, conditional, 1, preference=np.array([0.1, 0.2])).tolist() == [1]
    # min_prob still reads the probabilities: 0.5 < 0.6 drops both roots.
    assert best_path(parents, conditional, 1, min_prob=0.6, preference=np.array([0.1, 0.2])).size == 0


def _every_path_value(parents, conditional, preference, k, min_prob):
    """The best value over every root path of at most ``k`` usable nodes, by enumeration."""
    n = len(parents)
    reach, gain = list(conditional), list(preference)
    for i in range(n):
        if parents[i] >= 0:
            reach[i] *= reach[parents[i]]
            gain[i] *= gain[parents[i]]
    usable = [(r >= min_prob) if min_prob > 0 else r > 0 for r in reach]
    best = 0.0
    for end in range(n):  # the path from the root to ``end``, cut to k nodes
        path, node = [], end
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        total = 0.0
        for node in path[:k]:
            if not usable[node]:
                break
            total += gain[node]
        best = max(best, total)
    return best


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=40),
    probs=st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]), min_size=40, max_size=40),
    prefs=st.lists(st.floats(0.0, 1.0), min_size=40, max_size=40),
    k=st.integers(0, 9),
    min_prob=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_best_path_is_the_best_of_every_root_path(shape, probs, prefs, k, min_prob):
    """The compiled programme's path: a root path of at most k usable nodes whose value no other
    root path beats."""
    parents = _a([-1 if i == 0 else (p % (i + 1)) - 1 for i, p in enumerate(shape)])
    n = parents.size
    conditional, preference = np.array(probs[:n]), np.array(prefs[:n])
    path = best_path(parents, conditional, k, min_prob, preference).tolist()
    assert len(path) <= max(k, 0)
    if path:
        assert parents[path[0]] == -1 and all(parents[b] == a for a, b in itertools.pairwise(path))
    best = _every_path_value(parents.tolist(), probs[:n], prefs[:n], k, min_prob)
    got, value = 1.0, 0.0
    for node in path:
        got *= preference[node]
        value += got
    assert value == pytest.approx(best, abs=1e-9)


def test_empty_tree_and_zero_length():
    # Nothing to choose from, or nothing wanted: an empty path.
    assert best_path(_a([]), np.zeros(0), 4).size == 0
    assert best_path(_a([-1]), np.array([0.9]), 0).size == 0


# -- cut_to_chain --------------------------------------------------------------------------------


def test_cut_is_a_chain_with_cumulative_probabilities():
    t = _tree([5, 6, 7], [-1, -1, 1], [1.0, 1.0, 1.0], sources=[Tier.CONTEXT, Tier.PRIOR, Tier.DYNAMIC])
    c = cut_to_chain(t, 4, np.array([0.6, 0.5, 0.8]))
    # 6 7 (0.5 + 0.4) beats 5 alone (0.6); parents are -1, 0 as a chain's are.
    assert c.tokens.tolist() == [6, 7]
    assert c.parents.tolist() == [-1, 0]
    # The nodes keep their tiers; scores become the cumulative probabilities 0.5, 0.4.
    assert c.sources.tolist() == [Tier.PRIOR, Tier.DYNAMIC]
    assert c.scores.tolist() == pytest.approx([0.5, 0.4])


def test_cut_of_an_empty_tree_is_empty():
    # No nodes: an empty chain.
    assert len(cut_to_chain(DraftTree.empty(), 4, np.zeros(0))) == 0


# -- ChainCalibrator -----------------------------------------------------------------------------


def test_calibrator_learns_from_nodes_whose_parent_matched():
    cal = ChainCalibrator()
    # 5 and 9 come from different tiers, so they fall in cells of their own.
    t = _tree([5, 6, 9], [-1, 0, -1], [1.0, 1.0, 1.0], sources=[Tier.CONTEXT, Tier.CONTEXT, Tier.PRIOR])
    before = cal.conditional(t)
    # Before any outcome a node claims what its score ratio says: 1.0 for each here.
    assert before.tolist() == pytest.approx([1.0, 1.0, 1.0])
    for _ in range(20):
        cal.update(t, _a([5, 7]))
    after = cal.conditional(t)
    # Root 5 matched every time and root 9 never (both were trials at depth 1).
    assert after[0] > 0.8
    assert after[2] < 0.3
    # 6 sat under a matched parent and missed (7 came): it is learned to be unlikely.
    assert after[1] < 0.3


def test_calibrator_ignores_depths_the_outcome_does_not_reach():
    cal = ChainCalibrator()
    deep = _tree([5, 6], [-1, 0], [1.0, 1.0])
    for _ in range(20):
        cal.update(deep, _a([5]))  # one token: depth 2 is never seen
    other = _tree([8, 9], [-1, 0], [1.0, 1.0])
    # Depth 2 learnt nothing (its claim is untouched: only depth 1's cells moved).
    assert cal.conditional(other)[1] > 0.9


def test_calibrator_tells_sessions_on_track_from_those_off_it():
    cal = ChainCalibrator()
    t = _tree([5, 6], [-1, 0], [1.0, 1.0])
    # The same nodes, the same scores: followed whole after a session's last tree was followed
    # 16+ deep, missed after it was missed.
    deep = track_of(16)
    for _ in range(30):
        assert cal.update(t, _a([5, 6, 2]), track=deep) == 2  # followed 2 deep (the bonus past it)
        assert cal.update(t, _a([7]), track=0) == 0
    on, off = cal.conditional(t, track=deep), cal.conditional(t, track=0)
    assert on[0] > 0.9 and on[1] > 0.9
    assert off[0] < 0.1
    # A record between them learnt neither: its cells back off to every record's rate.
    assert 0.2 < cal.conditional(t, track=track_of(5))[0] < 0.8
    with pytest.raises(ValueError, match="track"):
        cal.conditional(t, track=TRACKS)


def test_calibrator_tells_the_child_a_chain_takes_from_the_alternatives_beside_it():
    cal = ChainCalibrator()
    # Two children scored alike (the first the best-scoring, ties to the earlier): the first is
    # always the target's next token, the second never. One cell over both would claim 0.5.
    t = _tree([5, 6, 7], [-1, 0, 0], [1.0, 0.5, 0.5])
    for _ in range(30):
        cal.update(t, _a([5, 6]))
    best, other = cal.conditional(t)[1:]
    assert best > 0.85 and other < 0.15


def test_a_chains_deep_claims_are_scaled_by_what_chains_cut_before_reached():
    cal = ChainCalibrator()
    claims = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    # Before any outcome the claims stand.
    assert cal.reach(claims).tolist() == pytest.approx(claims.tolist())
    # Chains whose claims said 0.5-0.9 at every depth, and whose first two tokens were reached,
    # never the third: the shallow claims held, the deep ones were far too high.
    tokens = _a([1, 2, 3, 4, 5])
    for _ in range(40):
        cal.update_reach(tokens, claims, _a([1, 2, 9]))
    reach = cal.reach(claims)
    assert reach[0] > 0.85 and reach[1] > 0.75
    assert reach[2] < 0.2 and reach[4] < 0.15
    assert np.all(np.diff(reach) <= 0)  # never rising along a chain
    # Sessions whose last tree was followed 16+ deep keep their own record: nothing learnt yet.
    assert cal.reach(claims, track=track_of(16)).tolist() == pytest.approx(claims.tolist())
    # An outcome that matched the chain to its end of what was verified says nothing of the rest.
    fresh = ChainCalibrator()
    for _ in range(40):
        fresh.update_reach(tokens, claims, _a([1, 2]))  # two accepted... and nothing past them known
    assert fresh.reach(claims)[2:].tolist() == pytest.approx(claims[2:].tolist())


def test_chains_cut_with_the_calibrator_end_where_their_reach_falls_below_the_threshold():
    cal = ChainCalibrator()
    claims = np.array([0.9, 0.8, 0.7, 0.6])
    for _ in range(40):
        cal.update_reach(_a([5, 6, 7, 8]), claims, _a([5, 6, 0]))
    t = _tree([5, 6, 7, 8], [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0])
    conditional = np.array([0.9, 0.8 / 0.9, 0.7 / 0.8, 0.6 / 0.7])
    chain, raw = chain_of(t, 4, conditional, 0.3, cal)
    assert chain.tokens.tolist() == [5, 6]  # the third claimed 0.7, chains like it never got there
    assert raw.tolist() == pytest.approx([0.9, 0.8])
    assert len(cut_to_chain(t, 4, conditional, 0.3)) == 4  # without it, the raw claims cut nothing


def _random_tree(rng, n):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]  # a parent before its children
    tokens = rng.integers(0, 50, n)
    return _tree(tokens, parents, rng.random(n), rng.integers(0, len(Tier), n))


def test_the_compiled_chain_is_the_calibrated_cut_step_by_step():
    """ChainCalibrator.chain (one compiled pass) picks, claims and reaches what the conditionals,
    the path and the reach scaling give one after another, for trained and fresh calibrators,
    every track record, cut or not."""
    rng = np.random.default_rng(7)
    cal = ChainCalibrator()
    for step in range(400):
        t, track = _random_tree(rng, int(rng.integers(1, 40))), step % TRACKS
        produced = rng.integers(0, 50, int(rng.integers(1, 6))).astype(np.int32)
        chain, claims = cal.chain(t, 8, 0.0, track)
        cal.update(t, produced, track)
        cal.update_reach(chain.tokens, claims, produced, track)
        if step % 50:
            continue
        for calibrator in (cal, ChainCalibrator()):
            for _ in range(10):
                t, track = _random_tree(rng, int(rng.integers(1, 60))), int(rng.integers(0, TRACKS))
                k, min_prob = int(rng.integers(1, 25)), float(rng.choice([0.0, 0.05, 0.2]))
                want, want_claims = chain_of(t, k, calibrator.conditional(t, track), min_prob, calibrator, track)
                got, got_claims = calibrator.chain(t, k, min_prob, track)
                assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
                assert got.sources.tolist() == want.sources.tolist()
                assert got.scores.tolist() == pytest.approx(want.scores.tolist())
                assert got_claims.tolist() == pytest.approx(want_claims.tolist())
    # A batch of trees (empty ones among them), each its own length, cut and track record.
    trees = [_random_tree(rng, int(n)) if n else _tree([], [], []) for n in rng.integers(0, 40, 30)]
    ks, mins, tracks = rng.integers(1, 25, 30), rng.choice([0.0, 0.05, 0.2], 30), rng.integers(0, TRACKS, 30)
    batch, claims = cal.chains(_batch_of(trees), ks, mins, tracks)
    for j, t in enumerate(trees):
        want, want_claims = cal.chain(t, int(ks[j]), float(mins[j]), int(tracks[j]))
        lo, hi = int(batch.offsets[j]), int(batch.offsets[j + 1])
        assert batch.tokens[lo:hi].tolist() == want.tokens.tolist()
        assert batch.parents[lo:hi].tolist() == want.parents.tolist()
        assert batch.sources[lo:hi].tolist() == want.sources.tolist()
        assert batch.scores[lo:hi].tolist() == want.scores.tolist() and claims[lo:hi].tolist() == want_claims.tolist()
    with pytest.raises(ValueError, match="tracks"):
        cal.chains(_batch_of(trees[:1]), ks[:1], mins[:1], np.array([TRACKS]))
    empty, raw = cal.chain(_tree([], [], []), 8)
    assert len(empty) == 0 and raw.size == 0
    with pytest.raises(ValueError, match="track"):
        cal.chain(_tree([1], [-1], [1.0]), 8, 0.0, TRACKS)


def test_a_session_retracing_its_prompt_gets_longer_chains_at_a_stopping_threshold():
    d = NamespaceDrafter(NS, DrafterConfig())
    text = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    prompt = [*text, 99, *text[:4]]  # the answer retraces the prompt's text, or leaves it

    def session(first: list[int]) -> Session:
        s = d.open(prompt)
        d.draft(s, DraftParams(chain=4))
        d.accept(s, _a(first))
        return s

    # Teach the calibrator: sessions on track stay on it, sessions that missed keep missing.
    for _ in range(40):
        on = session(text[4:8])
        assert on.track == 3
        d.draft(on, DraftParams(chain=4))
        d.accept(on, _a(text[8:12]))
        off = session([40])
        assert off.track == 0
        d.draft(off, DraftParams(chain=4))
        d.accept(off, _a([41]))
        d.close(on, commit=False)
        d.close(off, commit=False)
    # Off track, then back at the prompt's text: its context supports a long chain too.
    on, off = session(text[4:8]), session([40, *text[:4]])
    # At a 0.5 stopping threshold the session on track is proposed its chain, the one off it less.
    assert len(d.draft(on, DraftParams(chain=4, chain_min_prob=0.5))) == 4
    assert len(d.draft(off, DraftParams(chain=4, chain_min_prob=0.5))) < 4


# -- the drafter in chain mode -------------------------------------------------------------------


NS = Namespace(name="test", vocab_size=100)


@pytest.mark.parametrize("kw", [{"chain": -1}, {"chain": 129}, {"chain_min_prob": -0.1}, {"chain_min_prob": 1.0}])
def test_chain_params_are_checked(kw):
    # Out of range chain lengths and thresholds are refused.
    with pytest.raises(ValueError):
        DraftParams(**kw)


def test_chain_mode_drafts_a_chain_of_at_most_k_tokens():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open([5, 6, 7, 8, 9, 10, 11, 5, 6])
    chain = d.draft(s, DraftParams(chain=3))
    # "5 6" was followed by "7 8 9 10 11": the first three of them, as a chain.
    assert chain.tokens.tolist() == [7, 8, 9]
    assert chain.parents.tolist() == [-1, 0, 1]
    # Scores are cumulative probabilities: they never grow along the chain.
    assert np.all(np.diff(chain.scores) <= 0)


def test_chain_mode_keeps_the_tree_for_the_outcome():
    d = NamespaceDrafter(NS, DrafterConfig())
    s = d.open([5, 6, 7, 8, 5, 6, 9, 4, 5, 6])
    chain = d.draft(s, DraftParams(chain=2))
    tree = s.last_tree
    # The session holds the whole tree (both "7 ..." and "9 ..." after "5 6"), not the chain.
    assert tree is not None and len(tree) > len(chain)
    before = d.chain_calibrator.conditional(tree)
    d.accept(s, _a([9, 4]))
    after = d.chain_calibrator.conditional(tree)
    # The outcome taught the chain calibrator: what it expects of the tree's nodes moved.
    assert not np.allclose(before, after)


def test_tree_mode_is_unchanged_by_chain_mode_elsewhere():
    prompt = [5, 6, 7, 8, 5, 6, 9, 4, 5, 6]
    a = NamespaceDrafter(NS, DrafterConfig())
    b = NamespaceDrafter(NS, DrafterConfig())
    sa, sb = a.open(prompt), b.open(prompt)
    b.draft(sb, DraftParams(chain=2))  # b drafted a chain first: its tiers saw the same
    b.accept(sb, _a([7]))
    a.accept(sa, _a([7]))
    ta, tb = a.draft(sa, DraftParams()), b.draft(sb, DraftParams())
    # Chain mode leaves trees as they are.
    assert (ta.tokens.tolist(), ta.parents.tolist()) == (tb.tokens.tolist(), tb.parents.tolist())


def test_a_chain_drafted_in_one_compiled_call_is_the_tree_cut_after():
    """A batch of chain-mode jobs is drafted and cut in one compiled call; a batch mixing in a
    tree job drafts the trees first and cuts after. The same chains, claims and calibration
    either way, step after step as the calibrator learns."""
    rng = np.random.default_rng(3)
    phrases = [rng.integers(1, 100, int(n)).tolist() for n in rng.integers(3, 9, 6)]
    text = [t for i in rng.integers(0, len(phrases), 80) for t in phrases[i]]
    one, mixed = NamespaceDrafter(NS, DrafterConfig()), NamespaceDrafter(NS, DrafterConfig())
    sa, sb = one.open(text[:40]), mixed.open(text[:40])
    beside = mixed.open(text[:10])
    at = 40
    for _ in range(60):
        params = DraftParams(chain=int(rng.integers(1, 9)), chain_min_prob=float(rng.choice([0.0, 0.1])))
        a = one.draft_many([(sa, params)])[0]
        b = mixed.draft_many([(sb, params), (beside, DraftParams())])[0]
        assert (a.tokens.tolist(), a.parents.tolist(), a.sources.tolist()) == (
            b.tokens.tolist(), b.parents.tolist(), b.sources.tolist()
        )  # fmt: skip
        assert a.scores.tolist() == b.scores.tolist() and len(a) <= params.chain
        assert sa.chain is not None and sb.chain is not None
        assert sa.chain[1].tolist() == sb.chain[1].tolist() and sa.track == sb.track
        # The target takes the chain's first token where it is right, and the text's next.
        n = 1 + int(len(a) > 0 and a.tokens[0] == text[at % len(text)])
        produced = _a([text[(at + i) % len(text)] for i in range(n)])
        one.accept(sa, produced)
        mixed.accept(sb, produced)
        at += n
    assert one.chain_calibrator.trials == mixed.chain_calibrator.trials > 0


def _reach_counts_by_hand(tokens, claims, produced):
    """What update_reach counts, written out: (depth bin, claim bin) -> [hits, claims]."""
    from indexer.chain import _REACH_EDGES
    from indexer.kernels.chain import DEPTH_EDGES

    counts: dict[tuple[int, int], list[float]] = {}
    n = min(len(tokens), len(claims))
    if not n or not len(produced):
        return counts
    matched = 0
    while matched < min(n, len(produced)) and tokens[matched] == produced[matched]:
        matched += 1
    known = n if matched < len(produced) else matched
    for i in range(known):
        depth = int(np.searchsorted(DEPTH_EDGES, i + 1, side="right")) - 1
        cell = counts.setdefault((depth, int(np.searchsorted(_REACH_EDGES, claims[i], side="right"))), [0.0, 0.0])
        cell[0] += float(i < matched)
        cell[1] += claims[i]
    return counts


def test_a_cut_chains_outcome_counts_each_node_whose_reach_is_known():
    rng = np.random.default_rng(11)
    for _ in range(300):
        cal, track = ChainCalibrator(), int(rng.integers(0, TRACKS))
        n = int(rng.integers(0, 20))
        tokens = rng.integers(0, 3, n).astype(np.int32)
        claims = np.minimum.accumulate(rng.random(n)) if n else np.zeros(0)
        produced = rng.integers(0, 3, int(rng.integers(0, 12))).astype(np.int32)
        cal.update_reach(tokens, claims, produced, track)
        want = _reach_counts_by_hand(tokens.tolist(), claims.tolist(), produced.tolist())
        hits, claimed = cal._reach_hits[track], cal._reach_claims[track]
        assert {c for c in zip(*np.nonzero(claimed), strict=True)} <= set(want)
        for (d, b), (h, c) in want.items():
            assert hits[d, b] == h and claimed[d, b] == pytest.approx(c)
        assert hits.sum() == sum(h for h, _ in want.values())
        others = np.delete(cal._reach_hits, track, axis=0)
        assert not others.any()  # only the session's own track record learns
    with pytest.raises(ValueError, match="track"):
        ChainCalibrator().update_reach(_a([1]), np.ones(1), _a([1]), TRACKS)

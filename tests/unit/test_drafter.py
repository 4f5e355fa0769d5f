import numpy as np
import pytest

from indexer.calibration import Calibrator, Guesses
from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.lifetime_index import LifetimeConfig, prompt_key
from indexer.prior import PriorConfig, StaticPrior
from indexer.tokens import SEPARATOR, Namespace
from indexer.tree_builder import Tier

S = int(SEPARATOR)
NS = Namespace(name="test", vocab_size=100)


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _drafter(**kw):
    return NamespaceDrafter(NS, DrafterConfig(), **kw)


def _path_tokens(tree, target):
    return [int(tree.tokens[i]) for i in tree.accept(_a(target))]


def _path_sources(tree, target):
    return {Tier(int(tree.sources[i])) for i in tree.accept(_a(target))}


# -- DraftParams / DrafterConfig ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"budget": -1},
        {"budget": 1025},
        {"max_depth": 0},
        {"max_depth": 129},
        {"min_score": -0.1},
        {"min_score": 1.0},
        {"depth_reserve": -1},
        {"depth_reserve": 129},
    ],
)
def test_draft_params_validation(kw):
    # Each knob has a documented range; outside it is a caller error.
    with pytest.raises(ValueError):
        DraftParams(**kw)


def test_draft_params_bounds_are_inclusive():
    p = DraftParams(budget=1024, max_depth=128, min_score=0.0, depth_reserve=128)
    # The largest allowed values are accepted as given.
    assert (p.budget, p.max_depth, p.depth_reserve) == (1024, 128, 128)
    # A zero budget is allowed (it drafts nothing).
    assert DraftParams(budget=0).budget == 0


@pytest.mark.parametrize("name", ["max_match", "samples", "context_samples", "calibration_buckets"])
def test_drafter_config_validation(name):
    # Every count must be at least 1.
    with pytest.raises(ValueError, match=name):
        DrafterConfig(**{name: 0})


# -- open / accept validation -----------------------------------------------------------------


def test_open_rejects_out_of_vocabulary_ids():
    d = _drafter()
    # 100 is one past the 100-token vocabulary.
    with pytest.raises(ValueError, match=r"prompt: id 100 at position 1"):
        d.open([5, 100])
    # Negative ids are never valid.
    with pytest.raises(ValueError, match=r"id -3"):
        d.open(_a([-3]))


def test_open_rejects_wrong_dtype():
    d = _drafter()
    # An int64 array is a caller bug, not something to cast.
    with pytest.raises(ValueError, match="dtype"):
        d.open(np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="dtype"):
        d.open(np.array([1.0, 2.0], dtype=np.float32))


def test_accept_rejects_out_of_vocabulary_ids():
    d = _drafter()
    s = d.open([1, 2])
    # Accepted tokens are validated like the prompt.
    with pytest.raises(ValueError, match="accepted tokens"):
        d.accept(s, [100])
    # Nothing was added.
    assert s.context.tokens.tolist() == [1, 2]


# -- tiers -----------------------------------------------------------------------------------


def test_repeated_phrase_in_prompt_is_drafted_from_context():
    d = _drafter()
    s = d.open([5, 6, 7, 8, 5, 6])
    tree = d.draft(s, DraftParams(budget=4))
    # "5 6" was followed by "7 8 5 6": that chain is the draft.
    assert tree.tokens.tolist() == [7, 8, 5, 6]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    # All of it comes from the request's own context.
    assert set(tree.sources.tolist()) == {Tier.CONTEXT}


def test_successor_tier_carries_on_another_tiers_first_token():
    d = _drafter()
    # The target's top-k seen elsewhere: after 7 it writes 20, after 20 it writes 21; nothing
    # is known after 6 (the context's last token below).
    d.observe_followers([7, 20], [[20, -1], [21, -1]])
    s = d.open([5, 6, 7, 8, 5, 6])
    tree = d.draft(s, DraftParams(budget=8))
    paths = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)):
        paths[i] = (paths[parent] if parent >= 0 else ()) + (tok,)
    by_path = {p: int(tree.sources[i]) for i, p in paths.items()}
    assert by_path[(7,)] == Tier.CONTEXT  # the request's own text proposes 7 ...
    assert by_path[(7, 20)] == Tier.SUCCESSOR  # ... and the table knows what follows it
    assert by_path[(7, 20, 21)] == Tier.SUCCESSOR
    assert by_path[(7, 8)] == Tier.CONTEXT


def test_no_repeat_and_no_history_drafts_nothing():
    d = _drafter()
    s = d.open([1, 2, 3, 4])
    # Nothing in context, no lifetime memory, no prior: an empty tree.
    assert len(d.draft(s, DraftParams())) == 0


# Regression: at a46d8c2 draft() on an empty prompt raised IndexError (replay opens one for a
# conversation that starts with an output segment).
def test_empty_prompt_drafts_nothing_then_drafts_from_generated_text():
    d = _drafter()
    s = d.open([])
    # No context at all: nothing to draft from.
    assert len(d.draft(s, DraftParams())) == 0
    d.accept(s, [1, 2, 1])
    # Once the output repeats "1", what followed it ("2 1") is drafted.
    assert _path_tokens(d.draft(s, DraftParams()), [2, 1]) == [2, 1]


def test_budget_zero_drafts_nothing():
    d = _drafter()
    s = d.open([5, 6, 7, 8, 5, 6])
    # A zero budget always yields an empty tree.
    assert len(d.draft(s, DraftParams(budget=0))) == 0


def test_draft_respects_budget_and_depth():
    d = _drafter()
    s = d.open([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    tree = d.draft(s, DraftParams(budget=3, max_depth=2, depth_reserve=0))
    # At most 3 nodes, at most 2 deep.
    assert len(tree) <= 3
    assert tree.depths().max() <= 2
    # The best path is the continuation "3 4".
    assert _path_tokens(tree, [3, 4]) == [3, 4]


# Regression: at a46d8c2 a prior hit alone drafted nothing (the probs-only tree bug).
def test_prior_alone_drafts_its_followers():
    prior = StaticPrior.build(_a([1, 2, 3, 4, 9, 1, 2, 3, 4, 9]), PriorConfig(orders=(1, 2), follower_len=3))
    d = _drafter(prior=prior)
    s = d.open([50, 51, 1, 2])
    tree = d.draft(s, DraftParams())
    # "1 2" was always followed by "3 4 9" in the corpus.
    assert _path_tokens(tree, [3, 4, 9]) == [3, 4, 9]
    assert _path_sources(tree, [3, 4, 9]) == {Tier.PRIOR}


def test_prior_reinforces_context_match():
    prior = StaticPrior.build(_a([1, 2, 3, 4, 9, 1, 2, 3, 4, 9]), PriorConfig(orders=(1, 2), follower_len=3))
    with_prior, without = _drafter(prior=prior), _drafter()
    prompt = [1, 2, 3, 7, 1, 2]
    t1 = with_prior.draft(with_prior.open(prompt), DraftParams())
    t0 = without.draft(without.open(prompt), DraftParams())
    # Both draft "3" after "1 2" (seen in the prompt); the prior agrees, so it scores higher.
    assert t0.tokens[0] == t1.tokens[0] == 3
    assert t1.scores[0] > t0.scores[0]


def test_committed_request_drafts_from_lifetime_before_and_after_rebuild():
    d = _drafter()
    s = d.open([10, 11, 12, 13, 14])
    d.accept(s, [20, 21, 22, 23, 24, 25])
    d.close(s, commit=True)
    # A new request ending with "21 22 23" (from the committed response) has no match in itself...
    s2 = d.open([1, 2, 21, 22, 23])
    tree = d.draft(s2, DraftParams())
    # ...so its draft is the committed continuation "24 25", from the lifetime suffix index.
    assert _path_tokens(tree, [24, 25]) == [24, 25]
    assert _path_sources(tree, [24, 25]) <= {Tier.LIFETIME_SA, Tier.LIFETIME_NGRAM}
    d.memory.rebuild()
    # After the rebuild the main index holds the request and the delta is empty.
    assert d.memory.indexes is not None
    assert len(d.memory.suffix_indexes()) == 1
    tree = d.draft(d.open([1, 2, 21, 22, 23]), DraftParams())
    # Same draft, now from the rebuilt lifetime index.
    assert _path_tokens(tree, [24, 25]) == [24, 25]
    assert _path_sources(tree, [24, 25]) <= {Tier.LIFETIME_SA, Tier.LIFETIME_NGRAM}


# Regression: at a46d8c2 LIFETIME_NGRAM candidates alone drafted nothing (the probs-only tree bug).
def test_frequent_short_match_drafts_from_lifetime_table():
    d = _drafter()
    for prompt in ([40, 30, 31, 32, 33], [41, 30, 31, 32, 34]):
        d.close(d.open(prompt), commit=True)
    d.memory.rebuild()
    tree = d.draft(d.open([1, 30, 31, 32]), DraftParams())
    # "30 31 32" was followed by 33 once and 34 once: both are drafted, from the n-gram table.
    assert sorted(tree.tokens[tree.parents == -1].tolist()) == [33, 34]
    assert set(tree.sources.tolist()) == {Tier.LIFETIME_NGRAM}


def test_close_without_commit_forgets_request():
    d = _drafter()
    s = d.open([10, 11, 12])
    d.accept(s, [20, 21])
    d.draft(s, DraftParams())  # drafting holds the session's row in the store
    assert s in d.store
    d.close(s, commit=False)
    assert s not in d.store and d.store.held == 0  # its row goes, as a commit's does
    # Nothing joined the lifetime buffer or the exact-prompt cache.
    assert d.memory.buffer.requests == 0
    assert len(d.draft(d.open([10, 11, 12]), DraftParams())) == 0


def test_close_commit_from_skips_already_committed_tokens():
    d = _drafter()
    s = d.open([10, 11, 12])
    d.accept(s, [20, 21])
    d.close(s, commit=True, commit_from=3)
    # Only the tokens from position 3 (the response) join the buffer, then a separator.
    assert d.memory.buffer.snapshot().tolist() == [20, 21, S]


def test_exact_prompt_drafts_whole_previous_response():
    d = _drafter()
    prompt, response = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]
    s = d.open(prompt)
    d.accept(s, response)
    d.close(s)
    s2 = d.open(prompt)
    tree = d.draft(s2, DraftParams(budget=64, max_depth=32))
    # The identical prompt gets the previous response as one chain...
    assert _path_tokens(tree, response) == response
    # ...led by the exact-prompt tier.
    assert _path_sources(tree, response) == {Tier.EXACT}


def test_exact_prompt_continues_after_partial_acceptance_and_stops_on_divergence():
    d = _drafter()
    prompt, response = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]
    s = d.open(prompt)
    d.accept(s, response)
    d.close(s)
    s2 = d.open(prompt)
    d.draft(s2, DraftParams())
    d.accept(s2, [20, 21, 22])
    tree = d.draft(s2, DraftParams())
    # Still on the previous response: its rest "23 24 25" is drafted from EXACT.
    assert _path_tokens(tree, [23, 24, 25]) == [23, 24, 25]
    assert _path_sources(tree, [23, 24, 25]) == {Tier.EXACT}
    d.accept(s2, [99])
    tree = d.draft(s2, DraftParams())
    # The output left the previous response, so the exact tier drops out.
    assert Tier.EXACT not in set(tree.sources.tolist())


def test_exact_prompt_survives_drafting_ahead_for_an_outcome_that_leaves_it():
    d = _drafter()
    prompt, response = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]
    for output in ([30, 31, 32, 33], response):  # the prompt was answered twice, last by response
        s = d.open(prompt)
        d.accept(s, output)
        d.close(s)
    s2 = d.open(prompt)
    tree = d.draft(s2, DraftParams())
    assert {20, 30} <= set(tree.tokens[tree.parents == -1].tolist())
    ahead = d.prespeculate(s2, 16, DraftParams())
    # Drafting ahead supposed an outcome off the previous response...
    assert any(path[:1] == (30,) for path in ahead)
    d.accept(s2, [20, 21, 22])
    tree = d.draft(s2, DraftParams())
    # ...but the real outcome stayed on it, and its rest is still drafted from EXACT.
    assert _path_tokens(tree, [23, 24, 25]) == [23, 24, 25]
    assert _path_sources(tree, [23, 24, 25]) == {Tier.EXACT}


def test_exact_prompt_needs_identical_prompt():
    d = _drafter()
    s = d.open([10, 11, 12])
    d.accept(s, [20, 21])
    d.close(s)
    tree = d.draft(d.open([10, 11, 13]), DraftParams())
    # A different prompt (last token differs) gets no exact hit.
    assert Tier.EXACT not in set(tree.sources.tolist())


# -- accept / rejected branches / calibration ---------------------------------------------------


def test_accept_extends_context_and_records_rejected_branch():
    d = _drafter()
    s = d.open([5, 6, 7, 8, 5, 6])
    assert d.draft(s, DraftParams(budget=4)).tokens.tolist() == [7, 8, 5, 6]
    # The target produced 9 at once: the whole drafted chain was rejected at the root.
    d.accept(s, [9])
    assert s.context.tokens.tolist() == [5, 6, 7, 8, 5, 6, 9]
    assert s.generated.tolist() == [9]
    # The rejected chain is remembered under the context tail "5 6" where it branched off.
    assert s.rejected.table.followers((5, 6)) == [((7, 8, 5, 6), 1)]


def test_accept_partial_path_records_branch_below_accepted_prefix():
    d = _drafter()
    s = d.open([5, 6, 7, 8, 5, 6])
    d.draft(s, DraftParams(budget=4))
    # "7 8" were accepted, then the target's bonus token 10 replaced the drafted 5.
    d.accept(s, [7, 8, 10])
    assert s.context.tokens.tolist()[-3:] == [7, 8, 10]
    # The rejected rest "5 6" branched off after "... 7 8".
    assert s.rejected.table.followers((7, 8)) == [((5, 6), 1)]


def test_accept_with_fully_accepted_draft_records_nothing():
    d = _drafter()
    s = d.open([5, 6, 7, 8, 5, 6])
    d.draft(s, DraftParams(budget=2))
    # Both drafted tokens accepted, verification ended inside the tree: nothing was rejected.
    d.accept(s, [7, 8])
    assert len(s.rejected.table) == 0


def test_accept_empty_is_a_no_op():
    d = _drafter()
    s = d.open([1, 2])
    d.accept(s, [])
    # No tokens, no change.
    assert s.context.tokens.tolist() == [1, 2]


def test_accept_with_explicit_rejected_branches():
    d = _drafter()
    s = d.open([1, 2])
    # The branch 7 8 5 was rejected right at the start of the accepted tokens (offset 0).
    d.accept(s, [9], rejected=[(0, _a([7, 8, 5]))])
    # The context grows and the given branch is remembered.
    assert s.context.tokens.tolist() == [1, 2, 9]
    assert any(fol == (7, 8, 5) for _, fols in s.rejected.table.items() for fol, _ in fols)


def test_accept_rejects_a_bad_branch_offset():
    d = _drafter()
    s = d.open([1, 2])
    # Offset 1 would mean "after the first accepted token", but only one token was accepted.
    with pytest.raises(ValueError, match="offset"):
        d.accept(s, [9], rejected=[(1, _a([7]))])


def test_calibrator_starts_neutral_and_follows_hit_rate():
    cal = Calibrator(buckets=4)
    # No evidence: factor 1.
    assert cal.factor(Tier.CONTEXT, 3) == 1.0
    for _ in range(100):
        cal.update(Tier.CONTEXT, 3, predicted=0.5, hit=True)
    # Hit every time at predicted 0.5: the factor heads to 2 = 1 / 0.5, (100 + 2) / (50 + 2).
    assert cal.factor(Tier.CONTEXT, 3) == pytest.approx(102 / 52)
    for _ in range(100):
        cal.update(Tier.PRIOR, 3, predicted=0.5, hit=False)
    # Never hit: the factor heads to 0, 2 / (50 + 2).
    assert cal.factor(Tier.PRIOR, 3) == pytest.approx(2 / 52)
    # Other tiers and lengths are untouched.
    assert cal.factor(Tier.CONTEXT, 2) == 1.0


def test_calibrator_buckets_clamp_long_matches():
    cal = Calibrator(buckets=4)
    cal.update(Tier.DYNAMIC, 10, predicted=1.0, hit=False)
    # Lengths past the last bucket share it: 10 and 4 read the same factor, (0 + 2) / (1 + 2).
    assert cal.factor(Tier.DYNAMIC, 4) == pytest.approx(2 / 3)
    assert cal.factor(Tier.DYNAMIC, 99) == pytest.approx(2 / 3)
    # The table reports one rate per tier and bucket.
    assert len(cal.table()[Tier.DYNAMIC.name]) == 5


def test_calibrator_update_rows_is_one_update_per_guess_in_order():
    one_by_one, at_once = Calibrator(buckets=4), Calibrator(buckets=4)
    # Three drafted sequences' first guesses by tier (-1: none); rows 2 and 0 were verified.
    tokens = np.full((3, len(Tier)), -1, dtype=np.int64)
    predicted, lengths = np.zeros(tokens.shape), np.zeros(tokens.shape, dtype=np.int64)
    tokens[0, Tier.CONTEXT], predicted[0, Tier.CONTEXT], lengths[0, Tier.CONTEXT] = 7, 0.5, 2
    tokens[0, Tier.PRIOR], predicted[0, Tier.PRIOR], lengths[0, Tier.PRIOR] = 8, 0.25, 9
    tokens[1, Tier.CONTEXT], predicted[1, Tier.CONTEXT], lengths[1, Tier.CONTEXT] = 3, 0.9, 2
    tokens[2, Tier.CONTEXT], predicted[2, Tier.CONTEXT], lengths[2, Tier.CONTEXT] = 8, 0.1, 2
    block = Guesses(tokens, predicted, lengths)
    for row, actual in ((2, 8), (0, 8)):
        for g in block.of(row):
            one_by_one.update(g.tier, g.n, predicted=g.predicted, hit=g.token == actual)
    at_once.update_rows(block, np.array([2, 0]), np.array([8, 8]))
    assert at_once.table() == one_by_one.table()
    # CONTEXT: row 2 guessed 8 (hit), row 0 guessed 7 (miss); row 1 was not verified.
    assert at_once.factor(Tier.CONTEXT, 2) == pytest.approx((1 + 2) / (0.6 + 2))
    assert at_once.factor(Tier.PRIOR, 4) == pytest.approx((1 + 2) / (0.25 + 2))  # length 9: the last bucket


def test_drafter_calibration_moves_toward_outcomes():
    missed, hit = _drafter(), _drafter()
    for d, produced in ((missed, [9]), (hit, [7, 8, 10])):
        s = d.open([5, 6, 7, 8, 5, 6])
        d.draft(s, DraftParams(budget=4))
        d.accept(s, produced)
    # The CONTEXT tier guessed 7 after a 2-token match with predicted probability 0.5 (1 x 2/(2+2)).
    # A miss lowers its factor to (0 + 2) / (0.5 + 2); a hit raises it to (1 + 2) / (0.5 + 2).
    assert missed.calibrator.factor(Tier.CONTEXT, 2) == pytest.approx(0.8)
    assert hit.calibrator.factor(Tier.CONTEXT, 2) == pytest.approx(1.2)
    # And the next draft of the same situation is scored accordingly.
    t_missed = missed.draft(missed.open([5, 6, 7, 8, 5, 6]), DraftParams(budget=4))
    t_hit = hit.draft(hit.open([5, 6, 7, 8, 5, 6]), DraftParams(budget=4))
    assert t_missed.scores[0] == pytest.approx(0.5 * 0.8)
    assert t_hit.scores[0] == pytest.approx(0.5 * 1.2)


def test_close_rejects_commit_from_outside_the_context():
    d = _drafter()
    s = d.open([1, 2, 3])
    # The context has 3 tokens: committing from position 4 names nothing.
    with pytest.raises(ValueError, match="commit_from"):
        d.close(s, commit=True, commit_from=4)
    # Nothing was committed by the failed call.
    assert d.memory.buffer.size == 0


def test_commit_skips_the_turns_memory_already_holds():
    from indexer.drafter import MIN_SKIP

    d = _drafter()
    cfg = d.config
    rng = np.random.default_rng(0)
    turn1 = rng.integers(0, 100, 600).astype(np.int32)
    d.close(d.open(turn1), commit=True)
    # The next turn repeats the first and adds 50 tokens: only those (and an overlap) are added.
    turn2 = np.concatenate((turn1, rng.integers(0, 100, 50).astype(np.int32)))
    added = d.close(d.open(turn2), commit=True)
    assert added is not None and added.size == 50 + cfg.max_match
    assert added.tolist() == turn2[-(50 + cfg.max_match) :].tolist()
    # A short known part is not worth cutting: the whole request is added.
    short = np.concatenate((turn1[: MIN_SKIP // 2], _a([1, 2, 3])))
    assert d.close(d.open(short), commit=True).size == short.size
    # Without commit nothing is added.
    assert d.close(d.open(turn2), commit=False) is None


def test_commit_follows_turns_committed_piece_by_piece():
    d = _drafter()
    cfg = d.config
    rng = np.random.default_rng(1)
    context = rng.integers(0, 100, 400).astype(np.int32)
    d.close(d.open(context), commit=True)
    for _ in range(4):  # each turn repeats all before and adds 60 tokens; only those are added
        context = np.concatenate((context, rng.integers(0, 100, 60).astype(np.int32)))
        added = d.close(d.open(context), commit=True)
        assert added is not None and added.size == 60 + cfg.max_match


def test_close_many_commits_what_closing_one_by_one_does():
    one, many = _drafter(), _drafter()
    turns = [([10, 11, 12], [20, 21]), ([30, 31], [32, 33, 34]), ([10, 11, 12], [22])]
    sessions = {}
    for d in (one, many):
        sessions[id(d)] = []
        for prompt, response in turns:
            s = d.open(prompt)
            d.accept(s, response)
            sessions[id(d)].append(s)
    for s in sessions[id(one)]:
        one.close(s, commit=True)
    added = many.close_many([(s, 0) for s in sessions[id(many)]])
    # The same tokens join the buffer, and the exact-prompt cache keeps the last response.
    assert [a.tolist() for a in added] == [p + r for p, r in turns]
    assert one.memory.buffer.snapshot().tolist() == many.memory.buffer.snapshot().tolist()
    for d in (one, many):
        assert d.memory.exact_response(prompt_key(_a([10, 11, 12]))).tolist() == [22]
        assert d.memory.exact_response(prompt_key(_a([30, 31]))).tolist() == [32, 33, 34]


def test_lifetime_samples_are_shared_by_the_delta_runs_holding_the_match():
    # The same match in requests committed apart (separate delta runs) and together (one run):
    # as many continuation rows either way, standing for the same number of occurrences.
    requests = [[50 + i, 30, 31, 32, 33, 60 + i % 3] for i in range(40)]
    apart, together = _drafter(), _drafter()
    apart.memory.commit_many([_a(r) for r in requests[:30]])
    apart.memory.commit_many([_a(r) for r in requests[30:]])  # too small to merge into the first
    together.memory.commit_many([_a(r) for r in requests])
    assert len(apart.memory.suffix_indexes()) == 2 and len(together.memory.suffix_indexes()) == 1
    ctx = _a([1, 30, 31, 32, 33])
    samples = DrafterConfig().samples
    for d in (apart, together):
        n, rows, weights = d.memory.continuations(ctx, max_len=d.config.max_match, depth=4, samples=samples)
        assert n == 4
        assert samples <= rows.shape[0] <= samples + 1  # 40 occurrences, 32 samples
        assert weights.sum() == pytest.approx(40)


# -- well-formed drafts for any input ------------------------------------------------------------


def _check_well_formed(tree, params, vocab):
    n = len(tree)
    # Never more nodes than the budget, a chain never longer than asked for.
    assert n <= params.budget and (not params.chain or n <= params.chain)
    # Parents precede their children (-1: the context's last token) ...
    assert all(-1 <= p < i for i, p in enumerate(tree.parents.tolist()))
    # ... no path is deeper than max_depth, and a chain is one path.
    assert not n or tree.depths().max() <= params.max_depth
    assert not params.chain or tree.parents.tolist() == list(range(-1, n - 1))
    # Ids inside the vocabulary, probabilities finite in [0, 1].
    assert ((tree.tokens >= 0) & (tree.tokens < vocab)).all()
    assert np.isfinite(tree.scores).all() and ((tree.scores >= 0) & (tree.scores <= 1)).all()


def _followed(tree):
    """The tokens of the tree's first root path."""
    out, at = [], -1
    while (children := np.flatnonzero(tree.parents == at)).size:
        at = int(children[0])
        out.append(int(tree.tokens[at]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_drafts_are_well_formed_whatever_the_context_budget_and_feedback(seed):
    rng = np.random.default_rng(seed)
    vocab = [1, 2, 3, 50][seed % 4]  # a one-token vocabulary too: every id is 0 and vocab - 1
    lifetime = LifetimeConfig(capacity_tokens=[2, 5, 40][seed % 3], delta_max_tokens=4)
    prior = StaticPrior.build(rng.integers(0, vocab, 200).astype(np.int32), PriorConfig(orders=(1, 2), follower_len=3))
    d = NamespaceDrafter(Namespace(name="t", vocab_size=vocab), DrafterConfig(lifetime=lifetime), prior=prior)
    s = d.open(rng.integers(0, vocab, [0, 1, 2, 30][seed % 4]).astype(np.int32))  # empty and one-token contexts
    for step in range(300):
        params = DraftParams(
            budget=int(rng.choice([0, 1, 2, 16, 1024])),
            max_depth=int(rng.choice([1, 2, 128])),
            depth_reserve=int(rng.choice([0, 8, 128])),
            chain=int(rng.choice([0, 0, 1, 4, 128])),
        )
        tree = d.draft(s, params)
        _check_well_formed(tree, params, vocab)
        # Feedback at its extremes: the whole first path accepted, every guess rejected, or a
        # long run of tokens the draft knew nothing of.
        feedback = rng.integers(3)
        if feedback == 0:
            produced = [*_followed(tree), int(rng.integers(vocab))]
        elif feedback == 1:
            produced = [int(rng.integers(vocab))]
        else:
            produced = rng.integers(0, vocab, 20).tolist()
        d.accept(s, produced)
        if step % 60 == 59:  # the request ends; its tokens join the lifetime memory
            d.close(s)
            d.memory.rebuild()
            s = d.open(rng.integers(0, vocab, int(rng.integers(0, 3))).astype(np.int32))


def test_drafts_stay_well_formed_once_trees_rank_by_calibrated_chances():
    # Every draft's first path accepted for thousands of steps: the calibration counts grow
    # large and one-sided, and trees come to be ranked by the calibrator's chances.
    d = NamespaceDrafter(Namespace(name="t", vocab_size=3), DrafterConfig())
    s = d.open([0, 1, 2, 0, 1])
    rng = np.random.default_rng(0)
    for _ in range(1500):
        params = DraftParams(budget=int(rng.choice([1, 64, 1024])), max_depth=int(rng.choice([1, 128])))
        tree = d.draft(s, params)
        _check_well_formed(tree, params, 3)
        d.accept(s, [*_followed(tree), int(rng.integers(3))])
    assert d.chain_calibrator.trials >= 2000  # past the outcomes trees start ranking by it after

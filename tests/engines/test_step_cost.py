"""Where an engine proposer cuts its chains: the measured cost of a proposed token against the
time an accepted one saves, the time the engine takes per token it produces
(decoder_client.engines.step_cost)."""

from __future__ import annotations

import numpy as np
import pytest

from decoder_client.engines.settings import EngineSettings
from decoder_client.engines.step_cost import (
    KNEE_GAIN,
    MAX_FREE,
    MAX_MIN_PROB,
    MIN_SIDE,
    MIN_SPREAD,
    MIN_STEPS,
    MIN_TIMED,
    StepCost,
    _knee,
    _squared_error,
    chain_to_propose,
    cut,
)
from indexer.tree_builder import DraftTree


def steps(
    cost: StepCost,
    n: int,
    base: float,
    per_token: float,
    rows: int = 1,
    seed: int = 0,
    per_step: float = 0.0,
    accepted: float = 0.0,
) -> None:
    """``n`` steps of ``base + per_step * (proposed > 0) + per_token * proposed`` seconds (5%
    noise), 0-8 tokens proposed, each row producing one token and ``accepted`` of each step's
    proposed ones (rounded down)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        proposed = int(rng.integers(0, 9))
        seconds = base + per_step * (proposed > 0) + per_token * proposed
        produced = rows + int(accepted * proposed)
        cost.record(seconds * rng.uniform(0.95, 1.05), proposed, rows=rows, produced=produced)


def test_the_cut_is_a_proposed_tokens_cost_against_the_time_a_token_takes() -> None:
    cpu = StepCost(prior=0.3)
    steps(cpu, 200, base=0.020, per_token=0.006)  # llama.cpp on this CPU: 20 ms + 6 ms a token
    # Nothing accepted: a token takes a whole step, 44 ms on average with 4 tokens proposed.
    assert cpu.measured and cpu.min_prob == pytest.approx(0.006 / 0.044, abs=0.02)
    assert cpu.summary()["token_ms"] == pytest.approx(44, rel=0.05)
    gpu = StepCost(prior=0.3)
    steps(gpu, 200, base=0.015, per_token=0.0003)  # a GPU at batch 1: drafted tokens nearly free
    assert gpu.min_prob == pytest.approx(0.02, abs=0.01)


def test_the_time_a_token_takes_is_known_before_the_line() -> None:
    # A draft model's reads are priced against it (engines.beside): from the first few steps,
    # the cut still at the prior until the line is measured.
    cost = StepCost(prior=0.3)
    steps(cost, MIN_TIMED - 1, base=0.020, per_token=0.006)
    assert cost.token_s == 0.0 and not cost.measured
    steps(cost, 1, base=0.020, per_token=0.006, seed=1)
    assert cost.token_s == pytest.approx(0.044, rel=0.25) and not cost.measured and cost.min_prob == 0.3
    assert cost.costs(2).tolist() == pytest.approx([0.0, 0.3, 0.6])
    steps(cost, 200, base=0.020, per_token=0.006, seed=2)
    assert cost.measured and cost.token_s == pytest.approx(0.044, rel=0.05)
    configured = StepCost(prior=0.2, measure=False)  # a configured cost times nothing
    steps(configured, 200, base=0.020, per_token=0.006)
    assert configured.token_s == 0.0


def test_accepted_drafts_make_a_further_token_worth_less() -> None:
    # The same steps with half the proposed tokens accepted: a token takes 44 / 3 ms on average
    # (1 + 2 tokens a step), so a proposed token costing 6 ms must be likelier to pay.
    cost = StepCost(prior=0.3)
    steps(cost, 400, base=0.020, per_token=0.006, accepted=0.5)
    produced = 1 + np.mean([int(0.5 * p) for p in range(9)])
    assert cost.min_prob == pytest.approx(0.006 * produced / 0.044, abs=0.03)
    assert cost.min_prob > 0.3


def test_a_step_that_verifies_drafts_may_cost_more_than_its_tokens() -> None:
    # vLLM on a CPU: 125 ms a step, 30 ms more when it verifies any draft, 8 ms a token.
    cost = StepCost(prior=0.3)
    steps(cost, 300, base=0.125, per_step=0.030, per_token=0.008)
    s = cost.summary()
    assert s["step_base_ms"] == pytest.approx(125, rel=0.05) and s["step_drafting_ms"] == pytest.approx(30, rel=0.2)
    token_s = 0.125 + 0.030 * 8 / 9 + 0.008 * 4  # a step, producing one token
    assert cost.min_prob == pytest.approx(0.008 / token_s, abs=0.01)
    # A step's drafts must be expected to save 30 / 184 of a token's time beyond their tokens':
    assert cost.costs(1)[1] > 0.15  # one unlikely token does not pay
    assert cost.costs(4)[4] <= 2.0  # four that should mostly be accepted do
    # Where every step drafts (or none does), that cost cannot be told from the base: not asked.
    flat = StepCost(prior=0.3)
    for i in range(100):
        flat.record(0.125 + 0.030 + 0.008 * (1 + i % 8), 1 + i % 8, rows=1)
    assert flat.costs(1)[1] <= 0.3


def test_a_batch_makes_proposed_tokens_dearer() -> None:
    # An accepted token saves the time the engine takes per token: a step over its 16 rows. A
    # proposed token costing 1/44 of the step costs 16/44 of what an accepted one saves.
    batched = StepCost(prior=0.1)
    steps(batched, 200, base=0.040, per_token=0.001, rows=16)
    assert batched.min_prob == pytest.approx(16 / 44, abs=0.04)


def test_a_larger_batch_is_not_taken_for_dearer_tokens() -> None:
    # Continuous batching: the batch grows and shrinks as requests come and go, and a larger
    # batch proposes more (a chain per row). 20 ms a step, 4 ms a row, 1 ms a proposed token: a
    # fit without the rows puts their time down to the tokens the larger batches proposed.
    cost = StepCost(prior=0.3)
    rng = np.random.default_rng(0)
    for _ in range(400):
        rows = int(rng.integers(1, 17))
        proposed = int(rng.integers(0, 3 * rows + 1))
        seconds = 0.020 + 0.004 * rows + 0.001 * proposed
        cost.record(seconds * rng.uniform(0.97, 1.03), proposed, rows=rows, produced=rows)
    s = cost.summary()
    assert s["step_per_token_ms"] == pytest.approx(1.0, rel=0.15)
    assert s["step_per_row_ms"] == pytest.approx(4.0, rel=0.1)
    assert cost.min_prob == pytest.approx(0.001 / cost.token_s, rel=0.15)
    # The step times measured by tokens proposed, too: steps that proposed none were mostly
    # small batches, and those that proposed three larger ones.
    assert 3 in cost._at and 0 in cost._at
    assert cost.costs(3)[3] * cost.token_s == pytest.approx(0.003, rel=0.35)


def test_a_knee_is_seen_within_one_batch_size() -> None:
    # Every row proposes its K (4) tokens, so a batch of r rows proposes 4r: the rows and the
    # tokens rise together. Attention makes a larger batch dearer per row (2 ms x rows^2), and a
    # bend in the tokens' column beside the rows' one fits that curve as well as a knee would:
    # taken for one, it had the first 16 tokens free, and every chain cut at the floor.
    cost = StepCost(prior=0.3, floor=0.1)
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows = int(rng.integers(1, 9))
        seconds = 0.030 + 0.002 * rows * rows + 0.002 * 4 * rows
        cost.record(seconds * rng.uniform(0.97, 1.03), 4 * rows, rows=rows, produced=3 * rows)
    assert cost.measured and cost.free == 0 and cost.ask_prob == cost.min_prob > 0.1
    # Where one batch size does show it (four rows, 0 to 24 tokens), the knee is taken.
    for _ in range(200):
        proposed = int(rng.integers(0, 25))
        seconds = 0.062 + 0.004 * max(0, proposed - 6)
        cost.record(seconds * rng.uniform(0.97, 1.03), proposed, rows=4, produced=4 + proposed // 3)
    assert 5 <= cost.free <= 7


def test_a_step_verifies_its_first_tokens_for_nothing() -> None:
    # vLLM in float32 on this CPU, a 1,700-token context: 59 ms a step up to 4 proposed tokens
    # (the weights are read once a step, whatever it verifies), then 4.3 ms a token. A straight
    # line through those steps would find tokens past the knee cheaper than they are.
    cost = StepCost(prior=0.3, floor=0.1)
    rng = np.random.default_rng(0)
    for _ in range(400):
        proposed = int(rng.integers(0, 25))
        seconds = 0.059 + 0.0043 * max(0, proposed - 4)
        cost.record(seconds * rng.uniform(0.97, 1.03), proposed, rows=1, produced=1 + proposed // 3)
    s = cost.summary()
    assert 3 <= cost.free <= 5 and s["step_free_tokens"] == cost.free
    assert s["step_per_token_ms"] == pytest.approx(4.3, rel=0.1) and s["step_base_ms"] == pytest.approx(59, rel=0.05)
    assert cost.min_prob == pytest.approx(0.0043 / cost.token_s, rel=0.1)
    assert cost.ask_prob == 0.1  # the drafter cuts at the floor; the free tokens are kept down to it
    likely = [np.array([0.95, 0.8, 0.6, 0.3, 0.2, 0.15, 0.12])]
    (n,) = cost.keep(likely)
    assert 4 <= n <= 5  # the four free tokens, and a fifth only where it pays for itself (noise)
    # Free tokens cost nothing in a step's reckoning either: one unlikely token is worth a step.
    assert cost.costs(1)[1] <= 0.15
    # The same engine seen as a straight line: no knee, and one slope for every token.
    straight = StepCost(prior=0.3, floor=0.1)
    steps(straight, 400, base=0.059, per_token=0.004)
    assert straight.free == 0 and straight.ask_prob == straight.min_prob


def knee_one_bend_at_a_time(
    line: np.ndarray, proposed: np.ndarray, seconds: np.ndarray, kept: np.ndarray, error: float
) -> int:
    """What ``_knee`` finds for steps of one batch size, a least-squares fit per bend (how the
    fit went before every bend was fitted at once)."""
    free = 0
    counts = np.unique(proposed[kept])
    for knee in np.unique(proposed[(proposed > 0) & (proposed <= MAX_FREE)]).tolist():
        past = np.maximum(proposed - knee, 0.0)
        if np.count_nonzero(past) < MIN_SIDE or past.std() < MIN_SPREAD:
            continue
        if np.count_nonzero(counts <= knee) < 2 or counts.max() <= knee:
            continue  # no flat stretch to bend at, or nothing past it
        bent = line.copy()
        bent[:, -1] = past
        coef = np.linalg.lstsq(bent[kept], seconds[kept], rcond=None)[0]
        bent_error = _squared_error(bent[kept], seconds[kept], coef)
        if bent_error <= KNEE_GAIN * error:
            free, error = int(knee), bent_error
    return free


@pytest.mark.parametrize("seed", range(40))
def test_every_bend_fitted_at_once_finds_the_knee_one_at_a_time_finds(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(MIN_STEPS, 512))
    most = int(rng.integers(1, 25))
    proposed = np.where(rng.random(n) < rng.uniform(0, 0.9), 0, rng.integers(1, most + 1, n)).astype(np.float64)
    # Timed steps, noisy as measured ones are (with none, every fit's error is rounding's).
    knee, per_token, noise = int(rng.integers(0, 8)), rng.uniform(5e-4, 0.01), rng.uniform(1e-5, 3e-3)
    seconds = 0.03 + per_token * np.maximum(proposed - knee, 0) + np.abs(rng.normal(0, 1, n)) * noise
    drafted = (proposed > 0).astype(np.float64)
    columns = [np.ones(n), drafted, proposed] if seed % 2 else [np.ones(n), proposed]
    line = np.stack(columns, axis=1)  # with the drafting step's own column, and without
    kept = rng.random(n) > 0.05  # the steps a robust fit kept
    coef = np.linalg.lstsq(line[kept], seconds[kept], rcond=None)[0]
    error = _squared_error(line[kept], seconds[kept], coef)
    found = _knee(line, proposed, seconds, kept, error, np.ones(n))  # one batch size
    assert found == knee_one_bend_at_a_time(line, proposed, seconds, kept, error)


def measured(curve: dict[int, float], produced: int = 1, rounds: int = 20) -> StepCost:
    """A step cost that saw ``rounds`` steps of each number of proposed tokens in ``curve``,
    taking exactly the seconds it gives (each producing ``produced`` tokens)."""
    cost = StepCost(prior=0.5, floor=0.1)
    for _ in range(rounds):
        for proposed, seconds in curve.items():
            cost.record(seconds, proposed, rows=1, produced=produced)
    assert cost.measured
    return cost


def test_free_tokens_go_to_the_likeliest_drafts_of_any_row() -> None:
    # 50 ms a step up to 5 proposed tokens, then 20 ms a token; a token takes 77.3 ms on
    # average, so a token past the fifth costs 0.259 of one.
    cost = measured({k: 0.050 + 0.020 * max(0, k - 5) for k in range(11)})
    assert cost.free == 5 and cost.ask_prob == 0.1
    rows = [np.array([0.9, 0.45, 0.4, 0.2]), np.array([0.6, 0.42, 0.3]), np.array([]), np.array([0.12])]
    # The five likeliest for nothing (0.9, 0.6, 0.45, 0.42, 0.4), each chain in order; then 0.3,
    # worth its 0.259; not 0.2 nor 0.12.
    assert cost.keep(rows) == [3, 3, 0, 0]
    assert cost.keep([np.array([0.15, 0.11])]) == [2]  # within the free ones, any chance pays
    assert cost.keep([np.array([]), np.array([])]) == [0, 0]


def test_a_curve_no_line_follows_is_taken_as_measured() -> None:
    # vLLM in float32 here: one draft token makes a step 12 ms longer, two to four do not.
    curve = {0: 0.059, 1: 0.071, 2: 0.058, 3: 0.058, 4: 0.059, **{k: 0.059 + 0.0043 * (k - 4) for k in range(5, 13)}}
    cost = measured(curve)
    one = float(cost.costs(1)[1])
    assert one == pytest.approx(0.012 / cost.token_s, rel=0.05) and cost.costs(3)[3] == 0.0
    assert cost.keep([np.array([one + 0.05])]) == [1]  # a lone token likely enough to pay for the step
    assert cost.keep([np.array([one - 0.05])]) == [0]  # ... and one that is not
    assert cost.keep([np.array([one - 0.05, 0.12])]) == [2]  # two cost nothing: both go
    assert cost.costs(2)[2] <= 0.2


def test_the_prior_holds_until_the_line_is_known() -> None:
    cost = StepCost(prior=0.3)
    for _ in range(MIN_STEPS * 4):  # nothing proposed yet: the per-token cost is unknown
        cost.record(0.02, 0, rows=1)
    assert not cost.measured and cost.min_prob == 0.3
    for i in range(MIN_STEPS - 1):  # prompts evaluated in these steps: not steps of the line
        cost.record(5.0, i % 8, rows=1, counted=False)
    assert not cost.measured
    steps(cost, 64, base=0.020, per_token=0.002)
    assert cost.measured and cost.min_prob == pytest.approx(0.08, abs=0.02)


def test_odd_slow_steps_do_not_move_the_cut() -> None:
    cost = StepCost(prior=0.3)
    steps(cost, 300, base=0.020, per_token=0.004)
    clean = cost.min_prob
    for i in range(20):  # another process took the core for a few steps
        cost.record(1.5, i % 3, rows=1)
    steps(cost, 20, base=0.020, per_token=0.004, seed=1)
    assert cost.min_prob == pytest.approx(clean, abs=0.03)


def test_floor_cap_and_a_fixed_cost() -> None:
    floored = StepCost(prior=0.3, floor=0.2)
    steps(floored, 200, base=0.020, per_token=0.0002)
    assert floored.min_prob == 0.2
    dear = StepCost(prior=0.3)  # a token costs five steps and most are accepted: the cap, not 2
    steps(dear, 200, base=0.010, per_token=0.05, accepted=1.0)
    assert dear.min_prob == MAX_MIN_PROB
    fixed = EngineSettings(namespace="n", token_cost=0.25, chain_min_prob=0.1).step_cost()
    steps(fixed, 200, base=0.020, per_token=0.0002)
    assert not fixed.measured and fixed.min_prob == 0.25
    with pytest.raises(ValueError, match="token_cost"):
        EngineSettings(namespace="n", token_cost=1.0)
    with pytest.raises(ValueError):
        StepCost(prior=1.2)


def test_chains_are_cut_where_a_token_is_not_worth_its_cost() -> None:
    chain = DraftTree(
        np.array([5, 6, 7, 8], np.int32),
        np.array([-1, 0, 1, 2], np.int32),
        np.zeros(4, np.uint8),
        np.array([0.9, 0.6, 0.35, 0.1], np.float32),  # cumulative: the chance each is reached
    )
    tokens, claims, expected = chain_to_propose(chain, 8, 0.0)
    assert tokens.tolist() == [5, 6, 7, 8] and expected.sum() == pytest.approx(1.95)
    assert claims.tolist() == pytest.approx(expected.tolist())  # nothing corrects them
    tokens, _, expected = chain_to_propose(chain, 8, 0.3)
    assert tokens.tolist() == [5, 6, 7] and expected.sum() == pytest.approx(1.85)
    # Chances that correct the claims move the cut and the expectation, never the claims.
    tokens, claims, expected = chain_to_propose(chain, 8, 0.3, lambda c: np.minimum(1.0, 2 * c))
    assert tokens.tolist() == [5, 6, 7] and claims.sum() == pytest.approx(1.85)
    assert expected.tolist() == pytest.approx([1.0, 1.0, 0.7])
    tokens, _, _ = chain_to_propose(chain, 8, 0.3, lambda c: c / 2)
    assert tokens.tolist() == [5, 6]
    assert chain_to_propose(chain, 2, 0.3)[0].tolist() == [5, 6]  # and never longer than asked
    assert chain_to_propose(chain, 8, 0.95)[0].tolist() == []
    # A tree: its best root path, cut the same way.
    tree = DraftTree(
        np.array([5, 6, 7, 8], np.int32),
        np.array([-1, -1, 0, 0], np.int32),
        np.zeros(4, np.uint8),
        np.array([0.9, 0.05, 0.2, 0.5], np.float32),
    )
    assert chain_to_propose(tree, 8, 0.4)[0].tolist() == [5, 8]
    assert cut(np.array([1, 2]), np.array([0.2, 0.1]), 0.5).tolist() == []

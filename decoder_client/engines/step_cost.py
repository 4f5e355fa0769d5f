"""What a proposed token costs the engine, measured inside it: where a chain should stop.

A verification step takes longer the more tokens it checks, by an amount no fixed setting
knows: on a 2-core CPU a drafted token cost llama.cpp about 0.3 of a one-token step, vLLM
(bfloat16 without bf16 instructions) about 0.35, vLLM in float32 under 0.1; on a GPU at
batch 1 almost nothing, at a large batch nearly a whole row's step. The proposer sees both
sides of it: how many tokens it proposed for a step and, at its next call, how long that step
took. A least-squares fit through the latest steps, ``time = base + per_row * rows +
per_step * drafted + per_token * proposed`` (``drafted``: 1 where the step verified any draft;
vLLM, for one, runs its rejection sampler only then; ``rows`` where the batches differ: a
larger batch takes longer and proposes more, and without its own column its time would be put
down to the tokens it proposed), gives the costs. An accepted token is one token the engine
does not have to produce later, so it is worth the time a token takes now: the inverse of the
tokens the engine's steps produced per second over the same steps (with nothing accepted that
is one step per row, ``base / rows``; the more drafts are accepted, the less a further token
saves). So a token is worth proposing when the chance that it is accepted (its chain score:
the calibrated probability of being reached) is above ``per_token`` times that rate; the chain
is cut there. And a step's drafts, all rows together, are worth proposing when the tokens they
are expected to have accepted, less their cost, outweigh ``per_step`` (in the same units); else
the step goes without.

A step's first few tokens may cost nothing at all: an engine that streams the model's weights
from memory once per step (a CPU, a GPU at a small batch) verifies a handful of tokens in the
time it takes to verify one, and pays per token only past that knee (vLLM in float32 on this
2-core CPU, a 1,700-token context: 59 ms a step from 0 to 4 proposed tokens, then 4.3 ms a
token up to 24). A straight line through such steps puts the slope between the two, too cheap
past the knee. So the fit also tries the line bent at a knee, ``per_token * max(0, proposed -
free)``, for every ``free`` the steps show up to :data:`MAX_FREE` (bending within one batch
size: where each batch size had its own numbers of tokens, the rows' column fits a bend as
well), and keeps the bend that fits clearly better (:data:`KNEE_GAIN`). And where the steps
seen with a number of proposed tokens are enough, their median stands for it, the line
elsewhere: some curves follow no line (vLLM on this CPU verifies one draft token 12 ms slower
than two to five). Each step proposes its likeliest tokens, as many as make their expected
accepted number less their cost the largest (:meth:`StepCost.keep`); where a step's first tokens
are free, the drafter is asked for chains cut at the floor (:attr:`StepCost.ask_prob`), else at
:attr:`StepCost.min_prob`.

Steps that started a request (its prompt evaluated in them) and pauses are not steps of
the line; until enough steps with different numbers of proposed tokens have been seen, the
cost is the configured prior; and again once a whole window of steps drafted nothing (else a
measurement that priced every draft out would stand for good: steps that draft nothing never
correct it). What a produced token takes (:attr:`StepCost.token_s`, the worth of a second) is
known after :data:`MIN_TIMED` steps, whatever they proposed: a draft model's reads are priced by
it (:mod:`decoder_client.engines.beside`) before the line is measured.

>>> cost = StepCost(prior=0.3, floor=0.0)
>>> cost.min_prob
0.3
>>> for i in range(64):  # 20 ms a step, 5 ms per proposed token, one row, nothing accepted
...     proposed = i % 5
...     cost.record(0.020 + 0.005 * proposed, proposed, rows=1, produced=1)
>>> round(cost.min_prob, 3)  # 5 ms at 1 token per 30 ms on average
0.168
>>> cost.record(3.0, 2, rows=1, counted=False)  # a prompt's evaluation: not a step of the line
>>> round(cost.min_prob, 3)
0.168
>>> for i in range(512):  # the same steps, now producing 1 + proposed // 2 tokens each
...     proposed = i % 5
...     cost.record(0.020 + 0.005 * proposed, proposed, rows=1, produced=1 + proposed // 2)
>>> round(cost.min_prob, 2)  # a token takes 16.7 ms now: 5 ms is worth a 0.3 chance of one
0.3
>>> for i in range(512):  # a whole window of steps that drafted nothing: nothing left to measure
...     cost.record(0.020, 0, rows=1)
>>> cost.measured, cost.min_prob  # back to the prior, so that steps draft (and measure) again
(False, 0.3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from decoder_client.adapters import best_chain_nodes
from indexer.tree_builder import DraftTree

WINDOW = 512  # the latest steps the line goes through
MIN_STEPS = 24  # steps seen before the measurement replaces the prior ...
MIN_SPREAD = 0.5  # ... with at least this spread (standard deviation) of tokens proposed
REFIT_EVERY = 16  # steps between fits
MAX_MIN_PROB = 0.9  # never cut chains harder than this: the measurement may be off
MIN_SIDE = 8  # steps with drafts, and without, before a drafting step's own cost is measured
MAX_STEP_COST = 2.0  # ... and never more than this many steps' worth of drafts asked for
# Tokens proposed, grouped for the step times reported beside the fit.
PROPOSED_GROUPS = ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 8), (9, 12), (13, 16), (17, 24), (25, 1 << 20))
PRIOR = 0.3  # the cost until measured: a drafted token's share of a one-token step, CPU engines here
MAX_FREE = 16  # the most tokens a step is taken to verify at no cost (the knee, see the module docstring)
KNEE_GAIN = 0.8  # a knee is kept where its line leaves at most this share of the straight line's squared error
MIN_AT = 8  # steps seen with one number of proposed tokens before their median stands for it
MIN_TIMED = 8  # steps seen before, the line not yet measured, the time a token takes is taken from them


class StepCost:
    """The engine's cost per proposed token, and per step that verifies any, against a step's
    saving; see the module docstring."""

    _token: float | None  # the measured per_token / token_s (None: not measured, see _unmeasured)
    _at: dict[int, float]  # proposed tokens -> the median step seen with them (MIN_AT or more)

    def __init__(self, *, prior: float, floor: float = 0.0, measure: bool = True, window: int = WINDOW) -> None:
        if not 0 <= floor < 1 or not 0 <= prior < 1:
            raise ValueError(f"prior and floor must be in [0, 1), got {prior} and {floor}")
        self.prior, self.floor, self.measure = prior, floor, measure
        # The latest steps, (seconds, proposed, produced, rows) a row, in a ring: the fit takes
        # them as they lie (it does not depend on their order) rather than building an array a fit.
        self._steps = np.zeros((window, 4))
        self._held = 0  # steps in the ring
        self._next = 0  # the row the next step goes to
        self._since_fit = 0
        self._unmeasured()

    def record(
        self, seconds: float, proposed: int, *, rows: int, produced: int | None = None, counted: bool = True
    ) -> None:
        """The step that verified ``proposed`` tokens over ``rows`` rows took ``seconds`` and
        produced ``produced`` tokens (accepted and sampled, all rows; default one per row);
        ``counted=False``: a step that is not one of the line's (a prompt evaluated in it)."""
        if not (self.measure and counted) or seconds <= 0 or rows < 1:
            return
        made = float(rows if produced is None else produced)
        self._steps[self._next] = (seconds, float(proposed), max(made, 1.0), float(rows))
        self._next = (self._next + 1) % len(self._steps)
        self._held = min(self._held + 1, len(self._steps))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or self._token is None:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        if self._token is None and self._held >= MIN_TIMED:  # what a token takes is known sooner than the line
            steps = self._steps[: self._held]
            self.token_s = float(steps[:, 0].sum() / steps[:, 2].sum())
        if self._held < MIN_STEPS:
            return
        steps = self._steps[: self._held]
        seconds, proposed, produced, rows = steps[:, 0], steps[:, 1], steps[:, 2], steps[:, 3]
        if proposed.std() < MIN_SPREAD:
            if self._token is not None and np.count_nonzero(proposed) < MIN_SIDE and self._held == len(self._steps):
                self._unmeasured()  # see the method
            return
        drafted = (proposed > 0).astype(np.float64)
        # A step that verifies any draft may cost more than its tokens (vLLM runs its rejection
        # sampler only then): measured where there are enough steps of both kinds.
        both = min(drafted.sum(), (1 - drafted).sum()) >= MIN_SIDE
        # A batch of more rows takes longer whatever it verifies, and proposes more: where the
        # steps' batches differ, the rows are a column of their own, or the tokens' cost would
        # take in theirs.
        batches = rows.std() >= MIN_SPREAD
        columns = [np.ones(seconds.size), *([rows] if batches else []), *([drafted] if both else []), proposed]
        line = np.stack(columns, axis=1)
        coef, kept = _robust_line(line, seconds)
        error = _squared_error(line[kept], seconds[kept], coef)
        free = _knee(line, proposed, seconds, kept, error, rows)
        if free:
            a = line.copy()
            a[:, -1] = np.maximum(proposed - free, 0.0)
            coef, kept = _robust_line(a, seconds)
        coef = coef.tolist()
        per_row = coef[1] if batches else 0.0
        base, per_token = coef[0] + per_row * float(rows.mean()), max(0.0, coef[-1])
        if both:
            self.per_step_s = max(0.0, coef[-2])
        elif drafted.all():  # every step drafted: the base holds the per-step cost measured before
            base -= self.per_step_s
        if base <= 0:
            return
        self.base_s, self.per_row_s, self.per_token_s, self.free = base, per_row, per_token, free
        self._at = _medians_by_count(proposed, seconds - per_row * rows, MIN_AT)  # as if of one batch
        self.token_s = float(seconds[kept].sum() / produced[kept].sum())  # what an accepted token saves
        self._token, self._step = per_token / self.token_s, self.per_step_s / self.token_s

    def _unmeasured(self) -> None:
        """No measurement: the cost is the prior. So it starts; and so it goes back once the
        steps the measurement came from have all left the window with too few drafting since to
        measure again. A measurement that priced every draft out (drafting looked dear once)
        would otherwise stand for good, since steps that draft nothing never correct it, whatever
        the engine's later requests hold (a request asked again, whose chains are sure)."""
        self._token = None
        self._step = 0.0  # the measured per_step / token_s
        self.base_s = self.per_row_s = self.per_step_s = self.per_token_s = 0.0
        self.free = 0  # tokens a step verifies at no cost per token (the knee)
        self._at = {}
        self.token_s = 0.0  # the steps' time per token they produced (once MIN_TIMED are seen, measured or not)

    @property
    def measured(self) -> bool:
        return self._token is not None

    @property
    def min_prob(self) -> float:
        """The least chance of acceptance a proposed token should have."""
        ratio = self.prior if self._token is None else self._token
        return min(MAX_MIN_PROB, max(self.floor, ratio))

    @property
    def ask_prob(self) -> float:
        """The chance the drafter should cut chains at: the floor where a step's first tokens
        are free (:meth:`keep` chooses how much of the chains a step pays for), else
        :attr:`min_prob`: the drafter picks the chain best for the cut it is told, and a chain
        picked for the floor, then cut harder, is worse than one picked for the harder cut."""
        return self.floor if self.free else self.min_prob

    def costs(self, n_max: int) -> np.ndarray:
        """What proposing ``n`` tokens (all rows together) costs a step, in tokens' worth, for
        ``n`` from 0 to ``n_max``: the step's time with ``n`` proposed less its time with none,
        over the time a token takes. Measured: the median of the latest steps with ``n`` and
        with none where there were :data:`MIN_AT` of each (a curve no line follows: vLLM on
        this CPU takes longer to verify one draft token than two to five), else the fitted line
        (the tokens past the free ones at :attr:`min_prob` each, and the drafting step's own
        cost); not yet measured, :attr:`min_prob` a token.

        >>> StepCost(prior=0.25).costs(3).tolist()
        [0.0, 0.25, 0.5, 0.75]
        """
        n = np.arange(n_max + 1)
        if not self.measured:
            return self.min_prob * n
        out = np.where(n > 0, min(self._step, MAX_STEP_COST), 0.0) + self.min_prob * np.maximum(0, n - self.free)
        none = self._at.get(0)
        if none is not None and self.token_s > 0:
            for k, seconds in self._at.items():
                if 0 < k <= n_max:
                    out[k] = max(0.0, seconds - none) / self.token_s
        return out

    def keep(self, chances: Sequence[np.ndarray]) -> list[int]:
        """How many leading tokens of each row's chain to propose, given their chances of being
        reached (never rising along a chain, each at least :attr:`ask_prob`): the step's most
        likely tokens, each chain's in order, as many as make the expected accepted tokens less
        their cost (:meth:`costs`) the largest (none where nothing pays).

        >>> cost = StepCost(prior=0.4, floor=0.1)
        >>> cost.keep([np.array([0.9, 0.5, 0.3, 0.2]), np.array([0.45, 0.15]), np.array([])])
        [2, 1, 0]
        """
        sizes = [int(c.size) for c in chances]
        if not sum(sizes):
            return sizes
        flat = np.concatenate([np.asarray(c, dtype=np.float64) for c in chances])
        rows = np.repeat(np.arange(len(sizes)), sizes)
        at = np.concatenate([np.arange(n) for n in sizes])
        order = np.lexsort((at, -flat))  # likeliest first; a chain's tokens in order among equals
        value = np.concatenate(([0.0], np.cumsum(flat[order]))) - self.costs(flat.size)
        best = int(np.argmax(value))  # the fewest tokens among equal values
        return np.bincount(rows[order[:best]], minlength=len(sizes)).tolist()

    def summary(self) -> dict[str, Any]:
        """The measured figures (milliseconds) and the cut they give."""
        return {
            "cost_measured": self.measured,
            "step_base_ms": round(1e3 * self.base_s, 3),  # at the steps' mean batch
            "step_per_row_ms": round(1e3 * self.per_row_s, 3),  # 0: the batches did not differ
            "step_drafting_ms": round(1e3 * self.per_step_s, 3),
            "step_per_token_ms": round(1e3 * self.per_token_s, 3),
            "step_free_tokens": self.free,
            "token_ms": round(1e3 * self.token_s, 3),
            "chain_cut_prob": round(self.min_prob, 4),
            "step_ms_by_proposed": self.steps_by_proposed(),
        }

    def steps_by_proposed(self) -> dict[str, list[float]]:
        """The latest steps' median milliseconds, and how many there were, by tokens proposed
        (grouped as :data:`PROPOSED_GROUPS`): the curve the fitted line stands for.

        >>> cost = StepCost(prior=0.3)
        >>> for n in (0, 0, 2, 6):
        ...     cost.record(0.080 + 0.008 * n, n, rows=1)
        >>> cost.steps_by_proposed()
        {'0': [80.0, 2], '2': [96.0, 1], '5-6': [128.0, 1]}
        """
        if not self._held:
            return {}
        seconds, proposed = self._steps[: self._held, 0], self._steps[: self._held, 1]
        out: dict[str, list[float]] = {}
        for low, high in PROPOSED_GROUPS:
            at = (proposed >= low) & (proposed <= high)
            if at.any():
                name = str(low) if low == high else f"{low}-{high}"
                out[name] = [round(1e3 * float(np.median(seconds[at])), 3), int(at.sum())]
        return out


def _robust_line(a: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares ``seconds ~ a @ coef``, refitted without the steps far above the first fit
    (past four median deviations): the odd slow step (another process took the core) does not
    move it. Returns the coefficients and the mask of the steps kept."""
    coef, *_ = np.linalg.lstsq(a, seconds, rcond=None)
    residual = seconds - a @ coef
    keep = residual <= 4 * np.median(np.abs(residual)) + 1e-6
    coef, *_ = np.linalg.lstsq(a[keep], seconds[keep], rcond=None)
    return np.asarray(coef, dtype=np.float64), keep


def _knee(
    line: np.ndarray, proposed: np.ndarray, seconds: np.ndarray, kept: np.ndarray, error: float, rows: np.ndarray
) -> int:
    """The knee the steps show: the number of tokens ``free`` a step verifies for nothing, or
    0. Each of the steps' own numbers of proposed tokens from 1 to :data:`MAX_FREE`, smallest
    first, with at least :data:`MIN_SIDE` steps past it and a spread there, and seen bending
    within one batch (:func:`_bends_seen`), bends ``line`` (its last column becomes ``max(0,
    proposed - free)``); a bend fitted through the ``kept`` steps that leaves at most
    :data:`KNEE_GAIN` of the squared error of the best line before it (``error``, the straight
    one's to begin with) becomes the best. Every bend is fitted at once, through its normal
    equations: the pseudo-inverse of each small Gram matrix solves them as least squares would.

    >>> proposed = np.array([0.0, 1, 2, 3, 4, 5, 6, 7, 8] * 4)
    >>> seconds = 0.05 + 0.004 * np.maximum(proposed - 4, 0)  # free up to 4, then 4 ms a token
    >>> line = np.stack([np.ones(proposed.size), proposed], axis=1)
    >>> kept = np.ones(proposed.size, dtype=bool)
    >>> coef = np.linalg.lstsq(line, seconds, rcond=None)[0]
    >>> _knee(line, proposed, seconds, kept, _squared_error(line, seconds, coef), np.ones(proposed.size))
    4
    """
    knees = np.unique(proposed[(proposed > 0) & (proposed <= MAX_FREE)])
    if not knees.size:
        return 0
    past = np.maximum(proposed[None, :] - knees[:, None], 0.0)  # a row per knee
    measurable = (np.count_nonzero(past, axis=1) >= MIN_SIDE) & (past.std(axis=1) >= MIN_SPREAD)
    measurable &= _bends_seen(knees, proposed[kept], rows[kept])
    knees, past = knees[measurable], past[measurable][:, kept]
    if not knees.size:
        return 0
    fixed = line[kept, :-1]  # the columns every bend shares
    a = np.concatenate((np.broadcast_to(fixed, (knees.size, *fixed.shape)), past[:, :, None]), axis=2)
    y = seconds[kept]
    at = a.transpose(0, 2, 1)
    coefs = np.linalg.pinv(at @ a) @ (at @ y)[:, :, None]
    residual = y[None, :] - (a @ coefs)[:, :, 0]
    errors = (residual * residual).sum(axis=1)
    free = 0
    for knee, bent_error in zip(knees.tolist(), errors.tolist(), strict=True):  # each against the best line before it
        if bent_error <= KNEE_GAIN * error:
            free, error = int(knee), bent_error
    return free


def _bends_seen(knees: np.ndarray, proposed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Which ``knees`` steps of one batch size show: at least two numbers of proposed tokens up
    to the knee (a flat stretch, not one point) and one past it. Where every batch size had
    its own numbers of proposed tokens (each row proposing its K: 4 tokens at one row, 12 and
    16 at four, 20 at five), a bend and the rows' column together fit any curve through them,
    and noise alone would pick a knee; such steps say nothing of one.

    >>> knees = np.array([4.0, 12.0])
    >>> _bends_seen(knees, np.array([4.0, 12, 16, 20]), np.array([1.0, 4, 4, 5])).tolist()
    [False, False]
    >>> _bends_seen(knees, np.array([0.0, 4, 8, 12, 16]), np.array([4.0, 4, 4, 4, 4])).tolist()
    [True, True]
    """
    seen = np.zeros(knees.size, dtype=bool)
    for size in np.unique(rows).tolist():
        counts = np.unique(proposed[rows == size])
        below = np.count_nonzero(counts[None, :] <= knees[:, None], axis=1)
        seen |= (below >= 2) & (below < counts.size)
    return seen


def _medians_by_count(proposed: np.ndarray, seconds: np.ndarray, least: int) -> dict[int, float]:
    """The median step time per number of tokens proposed, where at least ``least`` steps had
    that number.

    >>> _medians_by_count(np.array([0.0, 0, 0, 2, 2, 5]), np.array([3.0, 1, 2, 8, 6, 9]), 2)
    {0: 2.0, 2: 7.0}
    """
    order = np.lexsort((seconds, proposed))
    counts, starts, sizes = np.unique(proposed[order], return_index=True, return_counts=True)
    ordered = seconds[order]
    out = {}
    for k, start, size in zip(counts.tolist(), starts.tolist(), sizes.tolist(), strict=True):
        if size >= least:
            mid = start + size // 2
            out[int(k)] = float(ordered[mid] if size % 2 else (ordered[mid - 1] + ordered[mid]) / 2)
    return out


def _squared_error(a: np.ndarray, seconds: np.ndarray, coef: np.ndarray) -> float:
    residual = seconds - a @ coef
    return float(residual @ residual)


def cut(tokens: np.ndarray, scores: np.ndarray, min_prob: float) -> np.ndarray:
    """A chain's leading tokens while its score (the cumulative chance of being reached, never
    rising along a chain) is at least ``min_prob``.

    >>> cut(np.array([7, 8, 9]), np.array([0.9, 0.4, 0.1]), 0.3).tolist()
    [7, 8]
    """
    below = np.flatnonzero(scores < min_prob)
    return tokens[: below[0]] if below.size else tokens


def chain_to_propose(
    tree: DraftTree,
    max_len: int,
    min_prob: float,
    chances: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``tree``'s best chain of at most ``max_len`` tokens, cut where a token is less likely
    than ``min_prob`` to be reached (:func:`cut`); its tokens' scores as the tree claims them;
    and their chances, the claims as ``chances`` corrects them (the proposer's own outcomes:
    :meth:`~decoder_client.engines.outcomes.ChainOutcomes.chances`; none: the claims), which
    the cut reads and whose sum is how many are expected to be accepted."""
    nodes = best_chain_nodes(tree, max_len)
    claims = tree.scores[nodes].astype(np.float64)
    likely = claims if chances is None else chances(claims)
    tokens = cut(tree.tokens[nodes], likely, min_prob)
    return tokens, claims[: tokens.size], likely[: tokens.size]

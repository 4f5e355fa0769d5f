"""Replaying logged traffic against a drafter: how many tokens per verification step (MAT)
would speculative decoding have produced?

The rule is exact for greedy decoding: at each step the drafter proposes a tree, the accepted
length is the longest root path equal to the recorded continuation, and the step yields the
accepted tokens plus one (the target's bonus token). Those tokens are fed back; the rest of the
tree counts as rejected. When a request ends, its new tokens join the drafter's history.

A decoder sees the target's logits at every position it verifies: the context's last token and
each accepted draft token. Where a trace records the target's top-k there (``Segment.topk``),
replay hands those rows over with the step's tokens, to drafters whose ``advance`` takes them.
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from benchmarks.traces import Conversation, Segment
from indexer.prespeculation import Prefetched, select
from indexer.tree_builder import DraftTree, Tier


class ReplayDrafter(Protocol):
    """What replay needs from a drafter; one request is active at a time."""

    name: str

    def start(self, prompt: np.ndarray) -> None: ...

    def propose(self) -> DraftTree: ...

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        """``tokens``: what the step yields (accepted draft tokens, then the bonus token). ``topk``
        (int32, ``(len(tokens), k)``), where the trace has it: row ``j`` is the target's top-k
        next tokens at the position that predicted ``tokens[j]`` (the one after the context's
        last token for ``j == 0``), exactly the positions the step verified."""

    def finish(self, commit_from: int) -> None: ...


@runtime_checkable
class DraftsAhead(Protocol):
    """A drafter that pre-speculates: it drafts ahead for the likely outcomes of the tree it
    proposed while the target verifies it (``draft_ahead``), holds what it drafted ahead for that
    tree (``ahead``: the trees by the accepted draft tokens they follow), and says whether the
    tree it just proposed had been drafted ahead (``last_was_ahead``)."""

    lookahead: int  # 0: it does not
    last_was_ahead: bool
    ahead: Prefetched

    def draft_ahead(self) -> None: ...


@runtime_checkable
class Foresees(Protocol):
    """A drafter told each request's output before it drafts for it, only to skip work that the
    output shows is wasted (:mod:`benchmarks.trace_cut`); what it proposes must not depend on it."""

    def reveal(self, output: np.ndarray) -> None: ...


@dataclass
class ReplayStats:
    name: str
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    requests: int = 0
    by_category: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    accepted_by_tier: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latencies_us: list[float] = field(default_factory=list)
    ahead_us: list[float] = field(default_factory=list)  # drafting ahead, hidden behind verification
    ahead_hits: int = 0  # steps whose tree was drafted ahead
    # Where a hit is lost: steps whose stopping point (the accepted draft tokens) had a tree
    # drafted ahead for it, and of those, the steps whose bonus token was among its roots.
    ahead_points: int = 0
    ahead_bonus: int = 0
    topk_rows: int = 0  # verified positions whose target top-k was handed to the drafter

    @classmethod
    def merged(cls, parts: Sequence[ReplayStats]) -> ReplayStats:
        """One drafter's replays of disjoint traffic (each namespace's, say) as one."""
        if not parts:
            raise ValueError("nothing to merge")
        out = cls(parts[0].name)
        for p in parts:
            out.steps += p.steps
            out.tokens += p.tokens
            out.drafted += p.drafted
            out.requests += p.requests
            out.ahead_hits += p.ahead_hits
            out.ahead_points += p.ahead_points
            out.ahead_bonus += p.ahead_bonus
            out.topk_rows += p.topk_rows
            out.latencies_us += p.latencies_us
            out.ahead_us += p.ahead_us
            for c, (tokens, steps) in p.by_category.items():
                out.by_category[c][0] += tokens
                out.by_category[c][1] += steps
            for tier, n in p.accepted_by_tier.items():
                out.accepted_by_tier[tier] += n
        return out

    @property
    def mat(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def summary(self) -> dict:
        lat = np.array(self.latencies_us) if self.latencies_us else np.zeros(1)
        return {
            "drafter": self.name,
            "mat": round(self.mat, 4),
            "steps": self.steps,
            "output_tokens": self.tokens,
            "requests": self.requests,
            "drafted_per_step": round(self.drafted / max(self.steps, 1), 2),
            "draft_us_p50": round(float(np.percentile(lat, 50)), 1),
            "draft_us_p99": round(float(np.percentile(lat, 99)), 1),
            "mat_by_category": {c: round(t / max(s, 1), 4) for c, (t, s) in sorted(self.by_category.items())},
            "accepted_by_tier": dict(sorted(self.accepted_by_tier.items())),
            **self._ahead_summary(),
            **({"topk_rows": self.topk_rows} if self.topk_rows else {}),
        }

    def _ahead_summary(self) -> dict:
        if not self.ahead_us:
            return {}
        ahead = np.array(self.ahead_us)
        return {
            "prespeculation_hit_rate": round(self.ahead_hits / max(self.steps - self.requests, 1), 4),
            # hit rate ~ point rate x bonus rate: which outcomes were drafted ahead for, and
            # whether the trees drafted there held the target's next token
            "prespeculation_point_rate": round(self.ahead_points / max(self.steps, 1), 4),
            "prespeculation_bonus_rate": round(self.ahead_bonus / max(self.ahead_points, 1), 4),
            "draft_ahead_us_p50": round(float(np.percentile(ahead, 50)), 1),
            "draft_ahead_us_p99": round(float(np.percentile(ahead, 99)), 1),
        }


def takes_topk(drafter: ReplayDrafter) -> bool:
    """Whether the drafter's ``advance`` takes the target's top-k (a ``topk`` parameter)."""
    try:
        return "topk" in inspect.signature(drafter.advance).parameters
    except (TypeError, ValueError):  # no signature to read: it does not say it takes them
        return False


def replay(
    conversations: Iterable[Conversation],
    drafter: ReplayDrafter,
    *,
    topk: bool = True,
    after_conversation: Callable[[int, ReplayStats], None] | None = None,
) -> ReplayStats:
    """Replay every output segment of every conversation, in order. With ``topk``, segments that
    record the target's top-k hand the verified positions' rows to a drafter that takes them.
    ``after_conversation(n, stats)`` is called once the ``n``-th conversation is replayed, with
    the statistics so far (a long replay's progress)."""
    stats = ReplayStats(drafter.name)
    feed = topk and takes_topk(drafter)
    for n, conv in enumerate(conversations, 1):
        parts: list[np.ndarray] = []
        committed = 0  # context tokens already committed by earlier requests of this conversation
        for seg in conv.segments:
            if seg.kind == "input":
                parts.append(seg.tokens)
                continue
            prompt = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
            _request(drafter, prompt, seg, stats, conv.category, feed)
            drafter.finish(committed)
            parts.append(seg.tokens)
            committed = prompt.size + seg.tokens.size
        if after_conversation is not None:
            after_conversation(n, stats)
    return stats


def _request(
    drafter: ReplayDrafter, prompt: np.ndarray, seg: Segment, stats: ReplayStats, category: str, feed: bool
) -> None:
    target = seg.tokens
    rows = seg.topk if feed else None
    drafter.start(prompt)
    if isinstance(drafter, Foresees):
        drafter.reveal(target)
    # Checked once a request: a runtime protocol check costs about as much as a draft.
    ahead = drafter if isinstance(drafter, DraftsAhead) and drafter.lookahead > 0 else None
    pos, steps = 0, 0
    while pos < target.size:
        t0 = time.perf_counter()
        tree = drafter.propose()
        stats.latencies_us.append((time.perf_counter() - t0) * 1e6)
        if ahead is not None:  # done while the target verifies
            stats.ahead_hits += int(ahead.last_was_ahead)
            t0 = time.perf_counter()
            ahead.draft_ahead()
            stats.ahead_us.append((time.perf_counter() - t0) * 1e6)
        path = tree.accept(target[pos:])
        for node in path:
            stats.accepted_by_tier[Tier(int(tree.sources[node])).name] += 1
        step = target[pos : pos + len(path) + 1]
        if ahead is not None and step.size > len(path):  # the request's end may leave no bonus token
            _score_ahead(ahead.ahead, step, stats)
        if rows is None:
            drafter.advance(step)
        else:  # the target's top-k at the positions this step verified: pos .. pos + accepted
            drafter.advance(step, topk=rows[pos : pos + step.size])
            stats.topk_rows += step.size
        pos += step.size
        steps += 1
        stats.drafted += len(tree)
    stats.steps += steps
    stats.tokens += int(target.size)
    stats.requests += 1
    cat = stats.by_category[category]
    cat[0] += int(target.size)
    cat[1] += steps


def _score_ahead(ahead: Prefetched, produced: np.ndarray, stats: ReplayStats) -> None:
    """Count whether the step that ``produced`` these tokens (accepted draft tokens, then the
    bonus token) ended at a stopping point drafted ahead for, and whether the tree drafted there
    has the bonus token among its roots (the next step then verifies its subtree).

    >>> ahead = {(5,): DraftTree.chain(np.array([7, 8], np.int32))}
    >>> stats = ReplayStats("d")
    >>> for produced in ([5, 7], [5, 9], [6, 7]):
    ...     _score_ahead(ahead, np.array(produced), stats)
    >>> stats.ahead_points, stats.ahead_bonus
    (2, 1)
    """
    if tuple(produced[:-1].tolist()) in ahead:
        stats.ahead_points += 1
        stats.ahead_bonus += select(ahead, produced) is not None  # the lookup that serves the next step

"""One request being decoded, and its portable snapshot (for storage and other replicas)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from indexer.context_index import ContextIndex
from indexer.prespeculation import Prefetched
from indexer.session_cache import RejectedCache
from indexer.tree_builder import DraftTree, Tier

if TYPE_CHECKING:
    from indexer.drafter import DrafterConfig

TableItems = list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], int]]]]


class Guess(NamedTuple):
    """A tier's most likely first token at the last draft, kept for calibration."""

    tier: Tier
    n: int
    token: int
    predicted: float


class Guesses(NamedTuple):
    """Every tier's first guess in one batch of drafts, by sequence and tier value: the token
    (-1: the tier had none), its probability and the match length it was found at."""

    tokens: np.ndarray  # int64 (sequences, tiers)
    predicted: np.ndarray  # float64 (sequences, tiers)
    lengths: np.ndarray  # int64 (sequences, tiers)

    def of(self, j: int) -> list[Guess]:
        """Sequence ``j``'s guesses, one per tier that had one."""
        return [
            Guess(Tier(t), n, tok, p)
            for t, (tok, p, n) in enumerate(
                zip(self.tokens[j].tolist(), self.predicted[j].tolist(), self.lengths[j].tolist(), strict=True)
            )
            if tok >= 0
        ]


@dataclass(frozen=True)
class SessionSnapshot:
    """Everything needed to continue a session elsewhere: its tokens and its rejected table.
    (The dynamic tier is read off the tokens themselves.)"""

    context: np.ndarray
    prompt_len: int
    rejected: TableItems = field(default_factory=list)


class Session:
    """One request being decoded: its context, rejected table, last draft.

    >>> from indexer.drafter import DrafterConfig
    >>> s = Session(np.array([1, 2, 3, 1, 2], dtype=np.int32), DrafterConfig(), None)
    >>> again = Session.restore(s.snapshot(), DrafterConfig(), None)
    >>> again.context.tokens.tolist(), again.prompt_len
    ([1, 2, 3, 1, 2], 5)
    """

    def __init__(self, prompt: np.ndarray, config: DrafterConfig, exact: np.ndarray | None) -> None:
        self.context = ContextIndex(prompt)
        self.prompt_len = int(prompt.size)
        self.rejected = RejectedCache(config.rejected)
        self.exact = exact
        self.exact_agrees = 0  # generated tokens known to equal the exact response's start; -1: they differ
        self.last_tree: DraftTree | None = None
        self.prefetched: Prefetched = {}  # trees drafted ahead for outcomes of last_tree
        self.guesses: tuple[Guesses, int] | None = None  # the last draft's batch and row in it
        self.hints = (0, 0)  # last match lengths of the own-context and lifetime-suffix tiers (0: none)

    @property
    def generated(self) -> np.ndarray:
        return self.context.tokens[self.prompt_len :]

    def snapshot(self) -> SessionSnapshot:
        return SessionSnapshot(
            context=self.context.tokens.copy(),
            prompt_len=self.prompt_len,
            rejected=self.rejected.table.items(),
        )

    @classmethod
    def restore(cls, snap: SessionSnapshot, config: DrafterConfig, exact: np.ndarray | None) -> Session:
        session = cls(snap.context[: snap.prompt_len], config, exact)
        session.context.extend(snap.context[snap.prompt_len :])
        for leader, followers in snap.rejected:
            for follower, count in followers:
                session.rejected.table.add(tuple(leader), tuple(follower), count)
        return session

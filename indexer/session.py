"""One request being decoded, and its portable snapshot (for storage and other replicas)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from indexer.context_index import ContextIndex
from indexer.kernels.store import EXACT_AGREES, HINT_CTX, HINT_LIFE, PROMPT_LEN, STATE_SIZE
from indexer.prespeculation import Prefetched
from indexer.session_cache import RejectedCache
from indexer.tree_builder import DraftTree, Tier

if TYPE_CHECKING:
    from indexer.drafter import DrafterConfig
    from indexer.session_store import SessionStore

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

    What compiled steps read and update lives in arrays: the context buffer, the prompt index,
    the rejected table and a state vector (lengths, hints; see :mod:`indexer.kernels.store`).
    A drafter holds a session's arrays in its store (``row``) while it drafts for it.

    >>> from indexer.drafter import DrafterConfig
    >>> s = Session(np.array([1, 2, 3, 1, 2], dtype=np.int32), DrafterConfig(), None)
    >>> again = Session.restore(s.snapshot(), DrafterConfig(), None)
    >>> again.context.tokens.tolist(), again.prompt_len
    ([1, 2, 3, 1, 2], 5)
    """

    def __init__(self, prompt: np.ndarray, config: DrafterConfig, exact: np.ndarray | None) -> None:
        self.state = np.zeros(STATE_SIZE, dtype=np.int64)
        self.context = ContextIndex(prompt, self.state)
        self.state[PROMPT_LEN] = prompt.size
        self.rejected = RejectedCache(config.rejected)
        self.exact = exact
        self.last_tree: DraftTree | None = None
        self.prefetched: Prefetched = {}  # trees drafted ahead for outcomes of last_tree
        self.guesses: tuple[Guesses, int] | None = None  # the last draft's batch and row in it
        self.row = -1  # in the store of the drafter holding its arrays (-1: none holds them)
        self.store: SessionStore | None = None

    @property
    def prompt_len(self) -> int:
        return int(self.state[PROMPT_LEN])

    @property
    def exact_agrees(self) -> int:
        """Generated tokens known to equal the exact response's start; -1: they differ."""
        return int(self.state[EXACT_AGREES])

    @exact_agrees.setter
    def exact_agrees(self, value: int) -> None:
        self.state[EXACT_AGREES] = value

    @property
    def hints(self) -> tuple[int, int]:
        """Last match lengths of the own-context and lifetime-suffix tiers (0: none)."""
        return int(self.state[HINT_CTX]), int(self.state[HINT_LIFE])

    @hints.setter
    def hints(self, value: tuple[int, int]) -> None:
        self.state[HINT_CTX], self.state[HINT_LIFE] = value

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
        for leader, followers in snap.rejected:  # ValueError on a leader or follower that is no table's
            for follower, count in followers:
                session.rejected.table.add(tuple(leader), tuple(follower), count)
        return session

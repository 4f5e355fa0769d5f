"""One request being decoded, and its portable snapshot (for storage and other replicas)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from indexer.calibration import Guesses
from indexer.context_index import ContextIndex
from indexer.kernels import store as kstore
from indexer.kernels.store import (
    EXACT_AGREES,
    FIRST_TOKEN,
    GUESS,
    GUESS_LENGTH,
    GUESSED,
    HINT_CTX,
    HINT_LIFE,
    N_TIERS,
    PROMPT_LEN,
    STATE_SIZE,
    TREE_SIZE,
)
from indexer.prespeculation import Prefetched
from indexer.session_cache import LruTableConfig, RejectedCache, TableColumns
from indexer.tree_builder import DraftTree

_FIRST_TREE = 64  # nodes the last tree's buffer holds at first (it grows with larger trees)


class HeldChain(NamedTuple):
    """A chain-mode session's last chain until its outcome comes: its tokens, their raw claims
    and the track record it was cut for (the chain calibrator learns from them), and the chain
    as it was sent (``sent[at]``: the draft call's trees, read only if asked for again).

    >>> chain = DraftTree.chain(np.array([4, 5], np.int32))
    >>> HeldChain(chain.tokens, np.ones(2), 0, [chain], 0).tree().parents.tolist()
    [-1, 0]
    """

    tokens: np.ndarray
    claims: np.ndarray
    track: int
    sent: Sequence[DraftTree]
    at: int

    def tree(self) -> DraftTree:
        """The chain as it was sent."""
        return self.sent[self.at]


@dataclass(frozen=True)
class SessionSnapshot:
    """Everything needed to continue a session elsewhere: its tokens and its rejected table.
    (The dynamic tier is read off the tokens themselves.)"""

    context: np.ndarray
    prompt_len: int
    rejected: TableColumns = field(default_factory=lambda: TableColumns.of_items([]))


class Session:
    """One request being decoded: its context, rejected table, last draft.

    What compiled steps read and update lives in arrays: the context buffer, the prompt index,
    the rejected table and a state vector (lengths, hints; see :mod:`indexer.kernels.store`).
    A drafter lists a session's arrays in its store (:mod:`indexer.session_store`) while it
    drafts for it; the session itself knows nothing of stores. ``rejected`` sizes its rejected
    table; ``exact`` is the response an identical prompt got before, if one did.

    >>> s = Session(np.array([1, 2, 3, 1, 2], dtype=np.int32), LruTableConfig(), None)
    >>> again = Session.restore(s.snapshot(), LruTableConfig(), None)
    >>> again.context.tokens.tolist(), again.prompt_len
    ([1, 2, 3, 1, 2], 5)
    """

    def __init__(self, prompt: np.ndarray, rejected: LruTableConfig, exact: np.ndarray | None) -> None:
        self.state = np.zeros(STATE_SIZE, dtype=np.int64)
        self.context = ContextIndex(prompt, self.state)
        self.state[PROMPT_LEN] = prompt.size
        self.rejected = RejectedCache(rejected)
        self.exact = exact
        self.state[TREE_SIZE] = -1
        self.tree_buffer = np.zeros(4 * _FIRST_TREE, dtype=np.int32)  # the last tree (see kernels.store)
        self.prefetched: Prefetched = {}  # trees drafted ahead for outcomes of last_tree
        # A chain-mode session's chains drafted ahead: their raw claims, by the outcome each
        # follows (accepted tokens, then the bonus token).
        self.ahead_chains: dict[tuple[int, ...], np.ndarray] = {}
        self.calibrates = False  # last_tree's outcome teaches chain calibration (chain mode, pre-speculation)
        self.track = 0  # how far the target followed the tree before last_tree (indexer.chain.track_of)
        self.chain: HeldChain | None = None  # the chain cut from last_tree, until its outcome

    @property
    def has_tree(self) -> bool:
        """Whether a tree waits for its verification outcome (see :attr:`last_tree`)."""
        return bool(self.state[TREE_SIZE] >= 0)

    @property
    def last_tree(self) -> DraftTree | None:
        """The tree drafted last, until the tokens verifying it come (a copy)."""
        n = int(self.state[TREE_SIZE])
        return None if n < 0 else DraftTree(*kstore.read_tree(self.tree_buffer, n))

    @last_tree.setter
    def last_tree(self, tree: DraftTree | None) -> None:
        if tree is None:
            self.state[TREE_SIZE] = -1
            return
        scores = np.ascontiguousarray(tree.scores, dtype=np.float32)
        written = kstore.write_tree(
            self.tree_buffer, self.state, np.ascontiguousarray(tree.tokens, dtype=np.int32),
            np.ascontiguousarray(tree.parents, dtype=np.int32), np.ascontiguousarray(tree.sources, dtype=np.int32),
            scores,
        )  # fmt: skip
        # The same buffer comes back (as another ndarray object) unless it grew; keeping the
        # object tells a store listing it that nothing was replaced.
        if written.size != self.tree_buffer.size:
            self.tree_buffer = written

    @property
    def guesses(self) -> tuple[Guesses, int] | None:
        """Each tier's first guess at the last draft, kept for calibration, as row 0 of a
        :class:`Guesses` (``None`` once the outcome came)."""
        if not self.state[GUESSED]:
            return None
        s = self.state
        return Guesses(
            s[FIRST_TOKEN:GUESS][None, :].copy(),
            s[GUESS:GUESS_LENGTH].view(np.float64)[None, :].copy(),
            s[GUESS_LENGTH : GUESS_LENGTH + N_TIERS][None, :].copy(),
        ), 0

    @guesses.setter
    def guesses(self, value: None) -> None:
        if value is not None:
            raise ValueError("guesses are kept by drafting; only forgetting them is allowed")
        self.state[GUESSED] = 0

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
            rejected=self.rejected.table.columns(),
        )

    @classmethod
    def restore(cls, snap: SessionSnapshot, rejected: LruTableConfig, exact: np.ndarray | None) -> Session:
        session = cls(snap.context[: snap.prompt_len], rejected, exact)
        session.context.extend(snap.context[snap.prompt_len :])
        for leader, followers in snap.rejected.items():  # ValueError on a leader or follower that is no table's
            for follower, count in followers:
                session.rejected.table.add(tuple(leader), tuple(follower), count)
        return session

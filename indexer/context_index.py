"""Matches inside one request's own context (prompt plus accepted output).

The prompt is indexed once with a suffix array when the request opens; tokens accepted since then
form a short tail that is searched directly. Together they answer "where else in this context do
its last ``n`` tokens occur, for the largest ``n``", and the continuations that followed.
"""

from __future__ import annotations

import numpy as np

from indexer import kernels
from indexer.kernels.store import INDEXED, LEN, STATE_SIZE
from indexer.suffix_array import SuffixIndex
from indexer.tokens import SEPARATOR

_MIN_INDEXED_PROMPT = 256  # shorter prompts are cheaper to scan than to index
_EMPTY = np.zeros(0, dtype=np.int32)


class ContextIndex:
    """A growing token context with longest-match lookups.

    >>> ctx = ContextIndex(np.array([4, 5, 6, 7, 4, 5], dtype=np.int32))
    >>> n, rows, weights = ctx.lookup(max_len=8, depth=3, samples=8)
    >>> n, rows.tolist()  # "4 5" occurred before, followed by "6 7 4"
    (2, [[6, 7, 4]])
    """

    def __init__(self, prompt: np.ndarray, state: np.ndarray | None = None) -> None:
        # Its length and indexed prefix live in ``state`` (a session's state vector, shared
        # with compiled steps that extend the buffer in place; see indexer.kernels.store).
        self.state = np.zeros(STATE_SIZE, dtype=np.int64) if state is None else state
        self.buffer = np.empty(max(64, 2 * prompt.size), dtype=np.int32)
        self.buffer[: prompt.size] = prompt
        self.state[LEN] = prompt.size
        # The index covers the prompt minus its last token, so every indexed occurrence is
        # followed by at least one token and the context's own suffix never matches itself.
        indexed = prompt.size - 1 if prompt.size > _MIN_INDEXED_PROMPT else 0
        self.state[INDEXED] = indexed
        sa = SuffixIndex(prompt[:indexed]) if indexed else None
        self._sa = (_EMPTY, _EMPTY) if sa is None else (sa.tokens, sa.suffix_array)  # tokens, suffix array

    def __len__(self) -> int:
        return int(self.state[LEN])

    @property
    def tokens(self) -> np.ndarray:
        return self.buffer[: self.state[LEN]]

    @property
    def indexed(self) -> int:
        """How many leading tokens the prompt index covers (0: none)."""
        return int(self.state[INDEXED])

    @property
    def prompt_index(self) -> tuple[np.ndarray, np.ndarray]:
        """The prompt index's ``(tokens, suffix array)``, both empty when nothing is indexed."""
        return self._sa

    def extend(self, tokens: np.ndarray) -> None:
        size = len(self)
        need = size + tokens.size
        if need > self.buffer.size:
            grown = np.empty(max(need, 2 * self.buffer.size), dtype=np.int32)
            grown[:size] = self.buffer[:size]
            self.buffer = grown  # a new object: a store listing the old one lists this one instead
        self.buffer[size:need] = tokens
        self.state[LEN] = need

    def lookup(self, *, max_len: int, depth: int, samples: int, hint: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
        """``(n, rows, weights)``: continuations after earlier occurrences of the longest
        matching suffix (length ``n``, 0 if none). Each row is ``depth`` tokens, -1 padded."""
        sa_tokens, sa = self._sa
        return kernels.context_continuations(
            self.tokens, sa_tokens, sa, self.indexed, max_len, hint, depth, samples, int(SEPARATOR)
        )

    def followers(
        self, *, leader_len: int, follower_len: int, keep: int, since: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, counts)``: the ``keep`` most recently seen distinct ``follower_len``-token
        continuations of the context's last ``leader_len`` tokens, among occurrences starting at
        ``since`` or later, with how often each followed (a session's dynamic table, computed
        when asked from the context itself)."""
        sa_tokens, sa = self._sa
        return kernels.context_followers(
            self.tokens, sa_tokens, sa, self.indexed, since, leader_len, follower_len, keep
        )

"""Matches inside one request's own context (prompt plus accepted output).

The prompt is indexed once with a suffix array when the request opens; tokens accepted since then
form a short tail that is searched directly. Together they answer "where else in this context do
its last ``n`` tokens occur, for the largest ``n``", and the continuations that followed.
"""

from __future__ import annotations

import numpy as np

from indexer import kernels
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

    def __init__(self, prompt: np.ndarray) -> None:
        self._buf = np.empty(max(64, 2 * prompt.size), dtype=np.int32)
        self._buf[: prompt.size] = prompt
        self._len = int(prompt.size)
        # The index covers the prompt minus its last token, so every indexed occurrence is
        # followed by at least one token and the context's own suffix never matches itself.
        self._indexed = self._len - 1 if self._len > _MIN_INDEXED_PROMPT else 0
        sa = SuffixIndex(prompt[: self._indexed]) if self._indexed else None
        self._sa = (_EMPTY, _EMPTY) if sa is None else (sa.tokens, sa.suffix_array)  # tokens, suffix array

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._len]

    @property
    def indexed(self) -> int:
        """How many leading tokens the prompt index covers (0: none)."""
        return self._indexed

    @property
    def prompt_index(self) -> tuple[np.ndarray, np.ndarray]:
        """The prompt index's ``(tokens, suffix array)``, both empty when nothing is indexed."""
        return self._sa

    def extend(self, tokens: np.ndarray) -> None:
        need = self._len + tokens.size
        if need > self._buf.size:
            grown = np.empty(max(need, 2 * self._buf.size), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : need] = tokens
        self._len = need

    def lookup(self, *, max_len: int, depth: int, samples: int, hint: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
        """``(n, rows, weights)``: continuations after earlier occurrences of the longest
        matching suffix (length ``n``, 0 if none). Each row is ``depth`` tokens, -1 padded."""
        sa_tokens, sa = self._sa
        return kernels.context_continuations(
            self.tokens, sa_tokens, sa, self._indexed, max_len, hint, depth, samples, int(SEPARATOR)
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
            self.tokens, sa_tokens, sa, self._indexed, since, leader_len, follower_len, keep
        )

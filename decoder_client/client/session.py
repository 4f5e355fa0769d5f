"""``ClientSession``: the client's view of one request."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from indexer.prespeculation import Prefetched
from indexer.tree_builder import DraftTree

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
TopkRows = Sequence[Sequence[int]] | np.ndarray  # per new token, the target's top-k ids where it was verified


class ClientSession:
    """The client's view of one request: its full context and its server session, if any.

    The context is kept as a list that a decode step appends its few tokens to: copying whole
    contexts into new arrays every step would cost the decoder time quadratic in a request's
    length. ``context`` makes an array of it (the local fallback and re-opens read it, rarely).

    >>> s = ClientSession([5, 6, 7], prompt_len=3)
    >>> s.extend([8])
    >>> s.context.tolist(), s.pending
    ([5, 6, 7, 8], [8])
    """

    __slots__ = (
        "_tokens",
        "asked_at",
        "chain",
        "chain_at",
        "pending",
        "pending_topk",
        "prefetched",
        "prompt_len",
        "server_id",
    )

    def __init__(self, context: Sequence[int] | np.ndarray, prompt_len: int) -> None:
        self._tokens: list[int] = np.asarray(context, dtype=np.int32).tolist()
        self.prompt_len = prompt_len
        self.server_id = ""  # "" while the service has no valid copy
        self.pending: list[int] = []  # produced since the last successful call
        self.pending_topk: list[int] = []  # top-k rows of the pending tokens, flat (see extend)
        self.prefetched: Prefetched = {}  # trees drafted ahead for the next outcome
        self.asked_at = 0  # the context's length when the last draft call was made for it
        self.chain: DraftTree | None = None  # chain mode: the service's last chain, drafted ...
        self.chain_at = 0  # ... for the context's first this many tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def context(self) -> np.ndarray:
        return np.array(self._tokens, dtype=np.int32)

    def tokens(self, start: int = 0) -> list[int]:
        """The context's tokens from ``start`` on, as a new list."""
        return self._tokens[start:]

    def extend(self, new: Sequence[int] | np.ndarray, topk: TopkRows | None = None, k: int = 0) -> None:
        """Append tokens the target produced (to the context, and to what the service has yet to
        hear), with, where given, the target's top-k ids where each was verified (``k`` ids a
        row: longer rows are cut, shorter ones padded with -1).

        >>> s = ClientSession([5], prompt_len=1)
        >>> s.extend([6, 7], topk=[[6, 2, 3], [7]], k=2)
        >>> s.take_topk(2)
        [6, 2, 7, -1]
        """
        if isinstance(new, np.ndarray):
            if new.dtype.kind not in "iu":
                raise TypeError(f"token ids must be integers, got an array of {new.dtype}")
            values = new.tolist()
        else:
            values = [int(t) for t in new]
        if values and not (min(values) >= _INT32_MIN and max(values) <= _INT32_MAX):
            raise OverflowError(f"token ids must be int32, got {values}")
        self._tokens.extend(values)
        before = len(self.pending)
        self.pending.extend(values)
        if topk is None or k <= 0:
            return
        if len(topk) != len(values):
            raise ValueError(f"{len(topk)} top-k rows for {len(values)} tokens")
        if len(self.pending_topk) != k * before:  # earlier pending tokens came without rows
            self.pending_topk = [-1] * (k * before)
        for row in topk:
            ids = [int(t) for t in row[:k]]
            self.pending_topk.extend(ids + [-1] * (k - len(ids)))

    def heard(self) -> None:
        """The service answered the last draft call made for this session: its copy holds the
        context as it was then (``asked_at`` tokens); tokens added since stay pending (a last
        step's, recorded before the close that settles a call made in the background).

        >>> s = ClientSession([5], prompt_len=1)
        >>> s.extend([6, 7]); s.asked_at = len(s); s.extend([8])
        >>> s.heard(); s.pending
        [8]
        """
        unheard = len(self._tokens) - self.asked_at
        self.pending = self.pending[len(self.pending) - unheard :] if unheard > 0 else []

    def take_topk(self, k: int) -> list[int] | None:
        """The pending tokens' top-k rows, flat, if every one has its row (``None`` otherwise);
        they are sent once: the next call starts without."""
        rows, self.pending_topk = self.pending_topk, []
        if k <= 0 or not self.pending or len(rows) != k * len(self.pending):
            return None
        return rows

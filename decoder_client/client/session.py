"""``ClientSession``: the client's view of one request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from indexer.prespeculation import Prefetched
from indexer.tree_builder import DraftTree

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class TopkAt:
    """The target's top-k at positions a decoder verified, each named by the token there:
    ``rows[i]`` are its likeliest next ids after ``after[i]``. A decoder that verified a tree
    names the root (the context's last token) and every node, rejected ones included: each is
    the target's own distribution after that token."""

    after: Sequence[int] | np.ndarray
    rows: Sequence[Sequence[int]] | np.ndarray

    def __post_init__(self) -> None:
        if len(self.after) != len(self.rows):
            raise ValueError(f"{len(self.rows)} top-k rows for {len(self.after)} positions")


# Per session, the target's top-k: a row per new token (where it was verified), or TopkAt.
TopkRows = Sequence[Sequence[int]] | np.ndarray | TopkAt


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
        "commit_key",
        "pending",
        "pending_after",
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
        # Top-k rows not sent yet, flat (see extend), and the token each follows.
        self.pending_topk: list[int] = []
        self.pending_after: list[int] = []
        self.prefetched: Prefetched = {}  # trees drafted ahead for the next outcome
        self.asked_at = 0  # the context's length when the last draft call was made for it
        self.chain: DraftTree | None = None  # chain mode: the service's last chain, drafted ...
        self.chain_at = 0  # ... for the context's first this many tokens
        self.commit_key = ""  # names the request's commit in every try of it ("" until it ends)

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
        hear), with, where given, the target's top-k: a row per new token (where it was
        verified), or :class:`TopkAt` (``k`` ids a row: longer rows are cut, shorter ones padded
        with -1). Each row is kept with the token it follows until it is sent.

        >>> s = ClientSession([5], prompt_len=1)
        >>> s.extend([6, 7], topk=[[6, 2, 3], [7]], k=2)
        >>> s.extend([8], topk=TopkAt([7, 9], [[8, 1], [4, 3]]), k=2)  # 9: a node the target rejected
        >>> s.take_topk(2)  # the rows, and the token each follows
        ([5, 6, 7, 9], [6, 2, 7, -1, 8, 1, 4, 3])
        """
        if isinstance(new, np.ndarray):
            if new.dtype.kind not in "iu":
                raise TypeError(f"token ids must be integers, got an array of {new.dtype}")
            values = new.tolist()
        else:
            values = [int(t) for t in new]
        if values and not (min(values) >= _INT32_MIN and max(values) <= _INT32_MAX):
            raise OverflowError(f"token ids must be int32, got {values}")
        after: list[int] = []
        rows: Sequence[Sequence[int]] | np.ndarray = []
        if k <= 0 or topk is None:
            pass
        elif isinstance(topk, TopkAt):
            after, rows = [int(t) for t in topk.after], topk.rows
        else:
            if len(topk) != len(values):
                raise ValueError(f"{len(topk)} top-k rows for {len(values)} tokens")
            last = self._tokens[-1:]  # row i follows the token before new[i]; with none before, row 0 goes
            after, rows = (last + values)[:-1], topk[1 - len(last) :]
        if after and not (min(after) >= _INT32_MIN and max(after) <= _INT32_MAX):
            raise OverflowError(f"top-k positions must be int32, got {after}")
        self._tokens.extend(values)
        self.pending.extend(values)
        self.pending_after.extend(after)
        for row in rows:
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

    def take_topk(self, k: int) -> tuple[list[int], list[int]] | None:
        """The rows not sent yet, flat, with the token each follows (``None``: none); they are
        sent once: the next call starts without. The tokens come back empty where the rows are
        one per pending token, each after the token before it: the form every version of the
        service reads (``topk_after`` unset).

        >>> s = ClientSession([5], prompt_len=1)
        >>> s.extend([6, 7], topk=[[6], [7]], k=1)
        >>> s.take_topk(1)
        ([], [6, 7])
        """
        after, rows = self.pending_after, self.pending_topk
        self.pending_after, self.pending_topk = [], []
        if k <= 0 or not after or len(rows) != k * len(after):
            return None
        n = len(self.pending)
        if len(after) == n and after == self._tokens[len(self._tokens) - n - 1 : len(self._tokens) - 1]:
            return [], rows
        return after, rows

"""What the service's calls take and give: the items of a batch, per call, and their answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from cache_service.domain.tenants import Principal
from indexer.drafter import DraftParams, NamespaceDrafter
from indexer.prespeculation import Prefetched
from indexer.tree_builder import DraftTree


@dataclass(frozen=True)
class OpenItem:
    namespace: str
    prompt: np.ndarray | list[int]
    params: DraftParams | None = None
    session_id: str = ""  # chosen by the client (empty: the service picks one)
    vocab_size: int = 0  # the vocabulary of the caller's model, checked against the namespace's (0: not stated)
    tokenizer: str = ""  # the fingerprint of the caller's tokenizer, checked likewise ("": not stated)


@dataclass(frozen=True)
class DraftItem:
    session_id: str
    new_tokens: np.ndarray | list[int]
    lookahead: int = 0  # outcomes to draft ahead for (pre-speculation)
    topk: np.ndarray | None = None  # (len(new_tokens), k) ids: the target's top-k where they were verified
    # With ``topk``: the token each row follows (a row per verified tree node, rejected ones
    # included); ``None``: row i follows the token before new_tokens[i].
    topk_after: np.ndarray | None = None


@dataclass(frozen=True)
class DraftColumns:
    """Draft items in columns, as a decoder stepping a batch sends them: session
    ``session_ids[j]`` takes the next ``counts[j]`` of ``tokens``, drafting ahead for
    ``lookahead[j]`` outcomes (``None``: none for every session)."""

    session_ids: Sequence[str]
    counts: np.ndarray  # int64, one per session
    tokens: np.ndarray  # int32, every session's new tokens end to end
    lookahead: np.ndarray | None = None  # int64, one per session
    topk: np.ndarray | None = None  # (tokens.size, k) ids: a top-k row per new token, or none
    # With ``topk``, per row the token it follows, and per session how many rows are its
    # (see DraftItem.topk_after); ``None``: a row per new token.
    topk_after: np.ndarray | None = None
    topk_counts: np.ndarray | None = None


def named_sessions(batch: Sequence[DraftItem] | DraftColumns) -> Sequence[str]:
    """The session ids a draft batch names, in order."""
    return batch.session_ids if isinstance(batch, DraftColumns) else [item.session_id for item in batch]


@dataclass(frozen=True)
class FeedbackItem:
    session_id: str
    accepted: np.ndarray | list[int]
    rejected: list[tuple[int, np.ndarray | list[int]]] | None = None


@dataclass(frozen=True)
class CloseItem:
    session_id: str
    commit: bool = True
    commit_from: int = 0
    missing_ok: bool = False  # an unknown session is skipped instead of NOT_FOUND
    new_tokens: np.ndarray | Sequence[int] = ()  # produced since the last call, joining the context first
    commit_key: str = ""  # names the commit in every retry of it ("": none; see names.commit_key)


@dataclass(frozen=True)
class NamespaceStats:
    name: str
    vocab_size: int
    buffered_tokens: int
    requests: int
    index_tokens: int
    last_rebuild_seconds: float
    prior_version: int
    sessions: int
    tokenizer: str = ""  # the registered tokenizer's fingerprint ("": none)


@dataclass(frozen=True)
class Opening:
    """An open call checked by :meth:`DraftService.prepare_open`: per item its drafter and
    checked prompt (``None`` where the item repeats the open of a live session); ``claimed``:
    the client-chosen ids storage holds for another tenant (never opened over); ``unchecked``:
    storage could not be read for them (it was down), so none is known to be claimed."""

    prepared: list[tuple[OpenItem, NamespaceDrafter, np.ndarray | None]]
    principal: Principal | None
    claimed: frozenset[str] = frozenset()
    unchecked: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(p.size for _, _, p in self.prepared if p is not None)


class Drafted(Sequence[tuple[DraftTree, Prefetched]]):
    """A draft call's answer, per item: its tree and the trees drafted ahead for it (``ahead``
    ``None``: nothing was). The trees of a batch drafted together stay where the draft step
    left them (:class:`~indexer.tree_builder.DraftedTrees`) until something asks for one."""

    __slots__ = ("ahead", "trees")

    def __init__(self, trees: Sequence[DraftTree], ahead: Sequence[Prefetched] | None = None) -> None:
        self.trees, self.ahead = trees, ahead

    def __len__(self) -> int:
        return len(self.trees)

    @overload
    def __getitem__(self, j: int) -> tuple[DraftTree, Prefetched]: ...

    @overload
    def __getitem__(self, j: slice) -> list[tuple[DraftTree, Prefetched]]: ...

    def __getitem__(self, j: int | slice) -> tuple[DraftTree, Prefetched] | list[tuple[DraftTree, Prefetched]]:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return self.trees[j], {} if self.ahead is None else self.ahead[j]

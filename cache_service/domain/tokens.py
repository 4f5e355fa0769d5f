"""The one check of the tokens a client sends, at the service boundary: every id in its
namespace's vocabulary (:func:`indexer.tokens.as_tokens`), its ``ValueError`` reported to the
client as :class:`InvalidArgument`. The indexer's ``*_checked`` calls then take them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cache_service.domain.errors import InvalidArgument
from cache_service.domain.items import DraftColumns
from cache_service.domain.sessions import SessionEntry
from indexer.drafter import MAX_LOOKAHEAD, NamespaceDrafter
from indexer.successors import checked_topk
from indexer.tokens import as_tokens


def checked(tokens: np.ndarray | Sequence[int], drafter: NamespaceDrafter, what: str) -> np.ndarray:
    """``tokens`` as a contiguous int32 array of ids in the drafter's vocabulary."""
    try:
        return as_tokens(tokens, drafter.namespace.vocab_size, what=what)
    except ValueError as exc:
        raise InvalidArgument(f"namespace {drafter.namespace.name}: {exc}") from exc


def lookahead(value: int) -> int:
    if not 0 <= value <= MAX_LOOKAHEAD:
        raise InvalidArgument(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {value}")
    return value


def column_shapes(cols: DraftColumns) -> np.ndarray:
    """A columnar batch's shapes checked (one count and lookahead per session, counts adding
    up to the tokens sent, lookahead in range); its lookahead, zeros when none was sent."""
    n = len(cols.session_ids)
    counts, tokens, ahead = cols.counts, cols.tokens, cols.lookahead
    if counts.shape != (n,):
        raise InvalidArgument(f"{counts.size} new-token counts for {n} sessions")
    if ahead is None or not ahead.size:
        ahead = np.zeros(n, dtype=np.int64)
    elif ahead.shape != (n,):
        raise InvalidArgument(f"{ahead.size} lookahead values for {n} sessions")
    if tokens.ndim != 1:
        raise InvalidArgument(f"new tokens must be a flat array, got shape {tokens.shape}")
    if n and (int(counts.min()) < 0 or int(counts.sum()) != tokens.size):
        raise InvalidArgument(f"new-token counts must add up to the {tokens.size} tokens sent")
    if not n and tokens.size:
        raise InvalidArgument(f"{tokens.size} new tokens for no session")
    if n and (int(ahead.min()) < 0 or int(ahead.max()) > MAX_LOOKAHEAD):
        raise InvalidArgument(f"lookahead must be in [0, {MAX_LOOKAHEAD}]")
    return ahead


def column_tokens(cols: DraftColumns, entries: Sequence[SessionEntry]) -> list[np.ndarray]:
    """Each session's new tokens of a batch whose shapes :func:`column_shapes` checked, every
    id checked against its session's vocabulary. Sessions of one vocabulary (the usual batch)
    are checked in one pass; the error names the session and position of the first bad id."""
    bounds = [0, *np.cumsum(cols.counts).tolist()]
    parts = [cols.tokens[bounds[j] : bounds[j + 1]] for j in range(len(entries))]
    drafters = {id(entry.drafter): entry.drafter for entry in entries}
    if len(drafters) == 1:
        try:
            as_tokens(cols.tokens, entries[0].drafter.namespace.vocab_size, what="new tokens")
            return parts
        except ValueError:
            pass  # found again below, session by session, to say where
    return [checked(part, entry.drafter, "new tokens") for part, entry in zip(parts, entries, strict=True)]


# A step's checked top-k: the token each row follows (``None``: the rows follow the step's new
# tokens, row 0 the session's last token) and the rows.
TopkPart = tuple[np.ndarray | None, np.ndarray]


def topk_rows(
    rows: np.ndarray | None, new: np.ndarray, drafter: NamespaceDrafter, after: np.ndarray | None = None
) -> TopkPart | None:
    """A step's top-k rows checked (:func:`indexer.successors.checked_topk`): 1 to 8 ids a row,
    each in the vocabulary or -1 (padding); a row per new token, or with ``after`` a row per
    token of it (each in the vocabulary)."""
    if rows is None:
        return None
    vocab = drafter.namespace.vocab_size
    try:
        if after is None:
            return None, checked_topk(rows, new.size, vocab)
        tokens = as_tokens(after, vocab, what="top-k positions")
        return tokens, checked_topk(rows, tokens.size, vocab)
    except ValueError as exc:
        raise InvalidArgument(f"namespace {drafter.namespace.name}: {exc}") from exc


def column_topk(
    cols: DraftColumns, news: Sequence[np.ndarray], entries: Sequence[SessionEntry]
) -> list[TopkPart | None]:
    """Each session's top-k rows of a columnar batch (``None`` for all when none were sent): a
    row per new token, or with ``topk_after`` the sessions' ``topk_counts`` rows each."""
    if cols.topk is None:
        return [None] * len(entries)
    if cols.topk_after is None:
        if cols.topk.ndim != 2 or cols.topk.shape[0] != cols.tokens.size:
            raise InvalidArgument(f"top-k must hold a row for each of the {cols.tokens.size} new tokens")
        bounds = [0, *np.cumsum(cols.counts).tolist()]
        return [
            topk_rows(cols.topk[bounds[j] : bounds[j + 1]], news[j], entries[j].drafter) for j in range(len(entries))
        ]
    counts, after = cols.topk_counts, cols.topk_after
    if counts is None or counts.shape != (len(entries),):
        raise InvalidArgument(f"top-k positions need a row count for each of the {len(entries)} sessions")
    if int(counts.min(initial=0)) < 0 or int(counts.sum()) != after.size or cols.topk.shape[0] != after.size:
        raise InvalidArgument(f"top-k row counts must add up to the {after.size} positions sent, a row each")
    bounds = [0, *np.cumsum(counts).tolist()]
    return [
        topk_rows(cols.topk[bounds[j] : bounds[j + 1]], news[j], entries[j].drafter, after[bounds[j] : bounds[j + 1]])
        for j in range(len(entries))
    ]

"""Proto <-> domain translation; nothing else."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.domain.admission import Admission
from cache_service.domain.errors import InvalidArgument
from cache_service.domain.items import (
    CloseItem,
    DraftColumns,
    Drafted,
    DraftItem,
    FeedbackItem,
    NamespaceStats,
    OpenItem,
)
from cache_service.rpc import wire
from indexer.drafter import DraftParams
from indexer.successors import MAX_TOPK
from indexer.tree_builder import DraftTree

_FEW = 32  # up to this many tokens, element by element beats a buffer copy


def tokens(field: Sequence[int]) -> np.ndarray:
    """A repeated int32 field as an int32 array (protobuf already bounds the values). A decode
    step's few tokens are read one by one (0.4 us, against 2.5 us for ``np.array``'s fixed cost);
    a prompt goes through ``np.array``, which copies the field's buffer at once."""
    n = len(field)
    if n <= _FEW:
        return np.fromiter(field, dtype=np.int32, count=n)
    return np.array(field, dtype=np.int32)


def params(msg: pb.DraftParams, default: DraftParams) -> DraftParams:
    try:
        return DraftParams(
            budget=msg.budget or default.budget,
            max_depth=msg.max_depth or default.max_depth,
            min_score=msg.min_score or default.min_score,
            depth_reserve=msg.depth_reserve or default.depth_reserve,
            chain=msg.chain or default.chain,
            chain_min_prob=msg.chain_min_prob or default.chain_min_prob,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def open_items(req: pb.OpenSessionsRequest, default: DraftParams) -> list[OpenItem]:
    return [
        OpenItem(
            s.namespace,
            tokens(s.prompt),
            params(s.params, default) if s.HasField("params") else None,
            s.session_id,
            s.vocab_size,
            s.tokenizer,
        )
        for s in req.sessions
    ]


def admit_draft(req: pb.DraftRequest, admission: Admission) -> None:
    """A draft request's sizes checked against the limits before any item or array is built."""
    if not req.HasField("columns"):
        admission.batch(len(req.items))
        for item in req.items:
            admission.topk_rows(len(item.topk_after))
        return
    c = req.columns
    admission.columns(len(c.session_ids), len(c.new_token_counts), len(c.lookahead), len(c.new_tokens))
    admission.topk_rows(len(c.topk_after), len(c.session_ids))


def topk(ids: Sequence[int], k: int, rows: int) -> np.ndarray | None:
    """A flat top-k field as ``rows`` rows of ``k`` ids (``None`` when none was sent)."""
    if not k and not len(ids):
        return None
    if not 1 <= k <= MAX_TOPK or len(ids) != k * rows:
        raise InvalidArgument(f"top-k: {len(ids)} ids are not {rows} rows of topk_k ids (1 to {MAX_TOPK}), topk_k {k}")
    return np.array(ids, dtype=np.int32).reshape(rows, k)


def _after(ids: Sequence[int], rows: np.ndarray | None) -> np.ndarray | None:
    """A ``topk_after`` field (``None`` when none was sent: rows follow the new tokens). It
    names the token each top-k row follows, so it comes with rows or not at all."""
    if not len(ids):
        return None
    if rows is None:
        raise InvalidArgument(f"top-k: {len(ids)} positions (topk_after) sent without top-k rows")
    return np.array(ids, dtype=np.int32)


def _draft_item(item: pb.DraftItem) -> DraftItem:
    rows = topk(item.topk, item.topk_k, len(item.topk_after or item.new_tokens))
    return DraftItem(item.session_id, tokens(item.new_tokens), item.lookahead, rows, _after(item.topk_after, rows))


def draft_items(req: pb.DraftRequest) -> list[DraftItem] | DraftColumns:
    if not req.HasField("columns"):
        return [_draft_item(item) for item in req.items]
    if len(req.items):
        raise InvalidArgument("a draft request holds items or columns, not both")
    c = req.columns
    rows = topk(c.topk, c.topk_k, len(c.topk_after or c.new_tokens))
    after = _after(c.topk_after, rows)
    if len(c.topk_counts) and after is None:
        raise InvalidArgument(f"top-k: {len(c.topk_counts)} row counts (topk_counts) sent without top-k positions")
    return DraftColumns(
        c.session_ids,
        np.array(c.new_token_counts, dtype=np.int64),
        np.array(c.new_tokens, dtype=np.int32),
        np.array(c.lookahead, dtype=np.int64),
        rows,
        after,
        np.array(c.topk_counts, dtype=np.int64) if after is not None else None,
    )


def draft_response(results: Drafted) -> wire.Encoded:
    """Trees, and what was drafted ahead when any item asked for it, as an encoded
    ``DraftResponse``: the trees are written straight in wire format (see
    :mod:`cache_service.rpc.wire`), and sent as they are unless something was drafted ahead."""
    trees = wire.encode_trees(results.trees)
    if results.ahead is None or not any(results.ahead):
        return wire.Encoded(trees)
    return wire.Encoded(trees + wire.encode_prefetched(results.ahead))


def admit_feedback(req: pb.FeedbackRequest, admission: Admission) -> None:
    """A feedback request's sizes checked against the limits before any item or array is
    built: the batch, and its rejected branches (their count, then their lengths)."""
    admission.batch(len(req.items))
    admission.branches(
        [len(item.rejected) for item in req.items],
        lambda: max((len(b.tokens) for item in req.items for b in item.rejected), default=0),
    )


def feedback_items(req: pb.FeedbackRequest) -> list[FeedbackItem]:
    return [
        FeedbackItem(
            item.session_id,
            tokens(item.accepted),
            [(b.offset, tokens(b.tokens)) for b in item.rejected] if len(item.rejected) else None,
        )
        for item in req.items
    ]


def close_items(req: pb.CloseSessionsRequest) -> list[CloseItem]:
    return [
        CloseItem(s.session_id, s.commit, s.commit_from, s.missing_ok, tokens(s.new_tokens), s.commit_key)
        for s in req.sessions
    ]


def tree(t: DraftTree) -> pb.Tree:
    return pb.Tree(
        tokens=t.tokens.tolist(), parents=t.parents.tolist(), sources=t.sources.tobytes(), scores=t.scores.tolist()
    )


def namespace_info(s: NamespaceStats) -> pb.NamespaceInfo:
    return pb.NamespaceInfo(
        name=s.name,
        vocab_size=s.vocab_size,
        buffered_tokens=s.buffered_tokens,
        requests=s.requests,
        index_tokens=s.index_tokens,
        last_rebuild_seconds=s.last_rebuild_seconds,
        prior_version=s.prior_version,
        sessions=s.sessions,
        tokenizer=s.tokenizer,
    )

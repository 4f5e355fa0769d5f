"""A batch's trees are merged together in one call: the result is what drafting each item in
its own call gives, across namespaces, draft parameters, drafts ahead and repeated sessions."""

from __future__ import annotations

import numpy as np

from cache_service.config import ServiceConfig
from cache_service.domain.items import CloseItem, DraftColumns, DraftItem, OpenItem
from cache_service.domain.service import DraftService
from indexer.drafter import DraftParams

_RNG = np.random.default_rng(7)
_PHRASES = [_RNG.integers(0, 50, size=12).tolist() for _ in range(6)]


def _text(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [t for _ in range(n) for t in _PHRASES[int(rng.integers(0, len(_PHRASES)))]]


def _service() -> DraftService:
    svc = DraftService(ServiceConfig())
    svc.create_namespace("a", 50)
    svc.create_namespace("b", 60)
    for ns, seed in (("a", 1), ("b", 2), ("a", 3)):  # some lifetime memory in each namespace
        (sid,) = svc.open([OpenItem(ns, _text(3, seed))])
        svc.draft_ahead([DraftItem(sid, np.array(_text(4, seed + 10), dtype=np.int32))])
        for job in svc.close([CloseItem(sid)]):
            job()
    return svc


def _trees(results):
    out = []
    for tree, ahead in results:
        out.append((tree.tokens.tolist(), tree.parents.tolist(), tree.sources.tolist()))
        out.append(sorted((path, t.tokens.tolist(), t.parents.tolist()) for path, t in ahead.items()))
    return out


def test_one_batch_drafts_what_items_one_by_one_draft() -> None:
    batched, single = _service(), _service()
    opens = [
        OpenItem("a", _text(2, 20)),
        OpenItem("b", _text(2, 21), DraftParams(budget=8, max_depth=4)),
        OpenItem("a", _text(2, 22), DraftParams(budget=24, min_score=0.05, depth_reserve=2)),
        OpenItem("b", _text(2, 23)),
    ]
    ids = batched.open(opens)
    assert single.open([OpenItem(o.namespace, o.prompt, o.params, sid) for o, sid in zip(opens, ids, strict=True)])
    for step in range(6):
        items = [
            DraftItem(sid, np.array(_text(1, 100 * step + i)[: 1 + (step + i) % 5], dtype=np.int32), lookahead=i % 3)
            for i, sid in enumerate(ids)
        ]
        if step % 2:  # a session named twice: its second item continues from its first
            items.append(DraftItem(ids[0], np.array([_PHRASES[0][0]], dtype=np.int32), lookahead=1))
        together = batched.draft_ahead(items)
        one_by_one = [r for item in items for r in single.draft_ahead([item])]
        assert _trees(together) == _trees(one_by_one)
        assert any(len(tree) for tree, _ in together)
    assert batched.drafts == single.drafts


def test_a_batch_in_columns_drafts_what_its_items_draft() -> None:
    by_items, by_columns = _service(), _service()
    opens = [OpenItem("a", _text(2, 30)), OpenItem("b", _text(2, 31)), OpenItem("a", _text(2, 32))]
    ids = by_items.open(opens)
    assert by_columns.open([OpenItem(o.namespace, o.prompt, o.params, sid) for o, sid in zip(opens, ids, strict=True)])
    for step in range(5):
        news = [np.array(_text(1, 10 * step + i)[: (step + i) % 4], dtype=np.int32) for i in range(len(ids))]
        sids, lookahead = list(ids), [i % 2 for i in range(len(ids))]
        if step % 2:  # a session named twice
            sids.append(ids[1])
            news.append(np.array([_PHRASES[1][0]], dtype=np.int32))
            lookahead.append(1)
        items = [DraftItem(s, n, k) for s, n, k in zip(sids, news, lookahead, strict=True)]
        columns = DraftColumns(
            sids, np.array([n.size for n in news]), np.concatenate(news), np.array(lookahead, dtype=np.int64)
        )
        assert _trees(by_columns.draft_ahead(columns)) == _trees(by_items.draft_ahead(items))
    assert by_columns.drafts == by_items.drafts

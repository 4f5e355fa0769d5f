"""Drafting ahead in a call of its own: an item with no new tokens that asks for outcomes ahead
gets the tree its session holds for that context and the trees ahead of it; the context is not
drafted again."""

from __future__ import annotations

import numpy as np

from cache_service.config import ServiceConfig
from cache_service.domain.items import DraftItem, OpenItem
from cache_service.domain.service import DraftService
from indexer.drafter import DraftParams
from indexer.tree_builder import DraftTree

_PROMPT = [3, 4, 5, 6, 3, 4, 5, 7, 3, 4, 5, 6, 3, 4]
_NONE = np.zeros(0, dtype=np.int32)


def _service() -> DraftService:
    svc = DraftService(ServiceConfig())
    svc.create_namespace("a", 50)
    return svc


def _same(a: DraftTree, b: DraftTree) -> bool:
    return a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def _teach_successors(svc: DraftService) -> None:
    """Another session reports the target's top-k after token 4 (the context's last): a tree
    drafted for that context from now on holds those tokens."""
    (other,) = svc.open([OpenItem("a", [9, 9])])
    rows = np.array([[40, 41, 42, 43]], dtype=np.int32)
    svc.draft_ahead([DraftItem(other, _NONE, topk=rows, topk_after=np.array([4], dtype=np.int32))])


def test_an_item_asking_only_for_outcomes_ahead_gets_the_held_tree_not_a_new_draft() -> None:
    svc = _service()
    (sid,) = svc.open([OpenItem("a", _PROMPT)])
    ((tree, ahead),) = svc.draft_ahead([DraftItem(sid, _NONE)])
    assert len(tree) and ahead == {}
    _teach_successors(svc)  # a second draft of the context would differ from the first
    ((again, ahead),) = svc.draft_ahead([DraftItem(sid, _NONE, lookahead=3)])
    assert _same(again, tree)
    assert len(ahead) == 3 and () in ahead  # the stopping points of the held tree, the root among them
    # Without lookahead an item with no new tokens is drafted anew, as before.
    ((fresh, none),) = svc.draft_ahead([DraftItem(sid, _NONE)])
    assert none == {} and not _same(fresh, tree)
    assert {40, 41}.issubset(set(fresh.tokens.tolist()))
    # The tokens of an outcome drafted ahead for continue with the subtree it selects.
    ((after, _),) = svc.draft_ahead([DraftItem(sid, np.array([5], dtype=np.int32), lookahead=2)])
    assert len(after)


def test_a_chain_session_asking_only_for_outcomes_ahead_gets_a_chain() -> None:
    svc = _service()
    (sid,) = svc.open([OpenItem("a", _PROMPT, DraftParams(chain=3))])
    ((chain, _),) = svc.draft_ahead([DraftItem(sid, _NONE)])
    ((again, _),) = svc.draft_ahead([DraftItem(sid, _NONE, lookahead=2)])
    for c in (chain, again):  # at most three tokens, one after another: never the tree it was cut from
        assert 0 < len(c) <= 3 and c.parents.tolist() == list(range(-1, len(c) - 1))

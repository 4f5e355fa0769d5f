"""Drafting ahead in a call of its own: an item with no new tokens that asks for outcomes ahead
gets the tree its session holds for that context and the trees ahead of it; the context is not
drafted again."""

from __future__ import annotations

import numpy as np
import pytest

from cache_service.config import ServiceConfig
from cache_service.domain.items import DraftItem, OpenItem
from cache_service.domain.service import DraftService
from indexer.drafter import DraftParams
from indexer.prespeculation import select
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


def test_a_chain_session_asking_only_for_outcomes_ahead_gets_its_chain_not_a_new_draft() -> None:
    svc = _service()
    (sid,) = svc.open([OpenItem("a", _PROMPT, DraftParams(chain=3))])
    ((chain, ahead),) = svc.draft_ahead([DraftItem(sid, _NONE)])
    assert ahead == {}
    held = svc.sessions.get(sid).session
    cut_from = held.last_tree  # the tree the chain was cut from, held until the outcome
    _teach_successors(svc)  # a second draft of the context would differ from the first
    ((again, ahead),) = svc.draft_ahead([DraftItem(sid, _NONE, lookahead=2)])
    assert cut_from is not None and held.last_tree is not None and _same(held.last_tree, cut_from)
    # The chain sent, as sent (never the tree it was cut from), and the outcomes ahead of it:
    # each drafted ahead at one of its own stopping points.
    assert 0 < len(chain) <= 3 and chain.parents.tolist() == list(range(-1, len(chain) - 1))
    assert _same(again, chain) and again.scores.tolist() == chain.scores.tolist()
    assert again.sources.tolist() == chain.sources.tolist()
    assert ahead and all(list(path) == chain.tokens[: len(path)].tolist() for path in ahead)
    # Without lookahead an item with no new tokens is drafted anew, as before.
    svc.draft_ahead([DraftItem(sid, _NONE)])
    assert held.last_tree is not None and not _same(held.last_tree, cut_from)
    assert {40, 41} & set(held.last_tree.tokens.tolist())


def test_a_chain_session_drafting_ahead_gets_the_chain_of_the_outcome_it_reports() -> None:
    svc = _service()
    (sid,) = svc.open([OpenItem("a", _PROMPT, DraftParams(chain=3))])
    ((chain, ahead),) = svc.draft_ahead([DraftItem(sid, _NONE, lookahead=2)])
    assert 0 < len(ahead) <= 2
    outcomes = {}
    for path, fan in ahead.items():
        # Drafted ahead at the chain's own stopping points: its first tokens accepted.
        assert list(path) == chain.tokens[: len(path)].tolist()
        for root in np.flatnonzero(fan.parents == -1).tolist():
            bonus = int(fan.tokens[root])
            rest = select(ahead, [*path, bonus])
            assert rest is not None and len(rest) <= 3 and rest.parents.tolist() == list(range(-1, len(rest) - 1))
            outcomes[(*path, bonus)] = rest
    assert outcomes
    (produced, want), *_ = outcomes.items()
    # Reporting that outcome, the session goes on with the chain drafted ahead for it.
    ((got, _),) = svc.draft_ahead([DraftItem(sid, np.array(produced, dtype=np.int32))])
    assert _same(got, want) and got.scores.tolist() == want.scores.tolist()


def test_a_busy_service_skips_drafting_ahead_and_counts_it() -> None:
    # A limit of 0: any drafting in the last second is too much, so only the first call (the
    # process idle until then) drafts ahead.
    svc = DraftService(ServiceConfig(ahead_busy_limit=0.0))
    svc.create_namespace("a", 50)
    (sid,) = svc.open([OpenItem("a", _PROMPT)])
    ((tree, ahead),) = svc.draft_ahead([DraftItem(sid, _NONE, lookahead=3)])
    assert len(ahead) == 3 and svc.ahead_skipped == 0
    ((again, none),) = svc.draft_ahead([DraftItem(sid, _NONE, lookahead=3)])
    assert none == {} and _same(again, tree)  # the draft it holds, nothing ahead of it
    assert svc.ahead_skipped == 1
    # Nothing drafted before is kept either: what the first call drafted ahead, for the tree
    # the second call served again, is dropped (the outcome is drafted afresh when it comes).
    session = svc.sessions.get(sid).session
    assert session.prefetched == {} and session.ahead_chains == {}
    path = next(iter(ahead))
    bonus = int(ahead[path].tokens[0])
    ((after, none),) = svc.draft_ahead([DraftItem(sid, np.array([*path, bonus], dtype=np.int32), lookahead=2)])
    assert none == {} and svc.ahead_skipped == 2 and len(after)
    # Items that ask for nothing ahead are not counted.
    svc.draft_ahead([DraftItem(sid, _NONE)])
    assert svc.ahead_skipped == 2


def test_by_default_drafting_ahead_is_never_skipped() -> None:
    svc = _service()
    (sid,) = svc.open([OpenItem("a", _PROMPT)])
    for _ in range(50):  # back to back: drafting fills the time
        ((_, ahead),) = svc.draft_ahead([DraftItem(sid, _NONE, lookahead=2)])
        assert len(ahead) == 2
    assert svc.ahead_skipped == 0
    with pytest.raises(ValueError, match="ahead_busy_limit"):
        ServiceConfig(ahead_busy_limit=1.5)

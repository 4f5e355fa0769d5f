"""What a client sends is checked once, at the service's boundary: an id outside its session's
vocabulary is InvalidArgument naming the namespace and the position within that session's
tokens, columns and items alike, and a refused call changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from cache_service.config import ServiceConfig
from cache_service.domain.errors import InvalidArgument, ResourceExhausted
from cache_service.domain.items import DraftColumns, DraftItem, OpenItem
from cache_service.domain.service import DraftService


def _service() -> tuple[DraftService, list[str]]:
    svc = DraftService(ServiceConfig(max_new_tokens=8))
    svc.create_namespace("a", 50)
    svc.create_namespace("b", 60)
    ids = svc.open([OpenItem("a", [1, 2, 3]), OpenItem("b", [4, 5, 6]), OpenItem("a", [7, 8])])
    return svc, ids


def _columns(ids: list[str], counts: list[int], tokens: list[int]) -> DraftColumns:
    return DraftColumns(ids, np.array(counts, np.int64), np.array(tokens, np.int32))


def _contexts(svc: DraftService, ids: list[str]) -> list[list[int]]:
    return [svc.sessions.get(sid).session.context.tokens.tolist() for sid in ids]


def test_a_bad_id_in_columns_names_its_session_and_position() -> None:
    svc, ids = _service()
    before = _contexts(svc, ids)
    # 55 is in b's vocabulary (60) but not in a's (50): the third session's second token.
    with pytest.raises(InvalidArgument, match=r"namespace a: new tokens: id 55 at position 1 is outside"):
        svc.draft_ahead(_columns(ids, [1, 2, 2], [1, 55, 2, 3, 55]))
    # One namespace (one pass over every token), same report.
    with pytest.raises(InvalidArgument, match=r"namespace a: new tokens: id 50 at position 0 is outside"):
        svc.draft_ahead(_columns([ids[0], ids[2]], [1, 1], [3, 50]))
    assert _contexts(svc, ids) == before  # a refused call changes nothing
    assert len(svc.draft_ahead(_columns(ids, [1, 2, 2], [1, 55, 2, 3, 4]))) == 3
    assert _contexts(svc, ids) == [[1, 2, 3, 1], [4, 5, 6, 55, 2], [7, 8, 3, 4]]


def test_columns_shapes_and_limits_are_checked() -> None:
    svc, ids = _service()
    with pytest.raises(InvalidArgument, match="add up"):
        svc.draft_ahead(_columns(ids, [1, 1, 1], [1, 2]))
    with pytest.raises(InvalidArgument, match="dtype int32"):
        svc.draft_ahead(DraftColumns(ids[:1], np.array([1], np.int64), np.array([1], np.int64)))
    with pytest.raises(ResourceExhausted):
        svc.draft_ahead(_columns(ids[:1], [9], [1] * 9))


def test_items_and_prompts_are_checked_alike() -> None:
    svc, ids = _service()
    with pytest.raises(InvalidArgument, match=r"namespace b: new tokens: id 60 at position 2 is outside"):
        svc.draft_ahead([DraftItem(ids[0], [1]), DraftItem(ids[1], [1, 2, 60])])
    with pytest.raises(InvalidArgument, match=r"namespace a: prompt: id 50 at position 1 is outside"):
        svc.open([OpenItem("b", [59]), OpenItem("a", [1, 50])])
    assert len(svc.sessions) == 3  # neither open held anything

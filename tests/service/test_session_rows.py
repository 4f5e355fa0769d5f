"""Sessions leaving the service leave their drafter's store: closed, expired or evicted."""

from __future__ import annotations

import time

import numpy as np

from cache_service.config import ServiceConfig
from cache_service.domain.items import CloseItem, DraftItem, OpenItem
from cache_service.domain.service import DraftService


def _held(svc: DraftService) -> int:
    return svc.namespace("toy").store.held


def _step(svc: DraftService, sid: str) -> None:
    svc.draft_ahead([DraftItem(sid, np.zeros(0, dtype=np.int32))])


def test_closed_expired_and_evicted_sessions_let_their_rows_go() -> None:
    svc = DraftService(ServiceConfig(session_ttl_s=0.2, max_session_tokens=100))
    svc.create_namespace("toy", 100)
    a, b = svc.open([OpenItem("toy", [1, 2, 3] * 10), OpenItem("toy", [4, 5] * 10)])
    for sid in (a, b):
        _step(svc, sid)
    assert _held(svc) == 2
    for job in svc.close([CloseItem(a)]):  # closed: gone at once, the commit comes after
        job()
    assert _held(svc) == 1
    (c,) = svc.open([OpenItem("toy", [6] * 60)])  # 20 + 60 tokens fit
    _step(svc, c)
    assert _held(svc) == 2
    (d,) = svc.open([OpenItem("toy", [7] * 30)])  # b (least recently used) leaves memory for it
    assert svc.sessions.evicted == 1 and _held(svc) == 1
    _step(svc, d)
    time.sleep(0.3)
    svc.open([OpenItem("toy", [8] * 10)])  # c and d expired meanwhile
    assert len(svc.sessions) == 1 and _held(svc) == 0

"""Sessions a decoder never closes (it died) leave memory once idle past the TTL, whether or not
anyone opens another session."""

from __future__ import annotations

import time

from cache_service.config import ServiceConfig
from cache_service.domain.items import OpenItem
from cache_service.domain.service import EXPIRE_BATCH, DraftService


def test_idle_sessions_leave_memory_with_the_write_back_round() -> None:
    svc = DraftService(ServiceConfig(session_ttl_s=0.2))
    svc.create_namespace("toy", 100)
    for start in range(0, EXPIRE_BATCH + 5, 256):  # then the decoder dies
        svc.open([OpenItem("toy", [1, 2, 3] * 10) for _ in range(min(256, EXPIRE_BATCH + 5 - start))])
    assert svc.stats("toy")[0].sessions == EXPIRE_BATCH + 5
    time.sleep(0.3)
    svc.take_changes()  # a write-back round, no open since: the idlest EXPIRE_BATCH go
    assert len(svc.sessions) == 5
    svc.take_changes()  # the next round, the rest
    assert len(svc.sessions) == 0 and svc.sessions.tokens == 0
    assert svc.stats("toy")[0].sessions == 0 and svc.namespace("toy").store.held == 0

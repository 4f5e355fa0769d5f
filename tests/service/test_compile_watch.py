"""Compilations while serving are logged, timed and counted, and only while watched."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from numba import njit

from cache_service.host.compiles import CompileWatch
from cache_service.metrics import Metrics


def test_a_compilation_while_watched_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    watch = CompileWatch(metrics.observe_compile)

    @njit
    def late(x: np.ndarray) -> float:
        return float(x.sum())

    @njit
    def before(x: np.ndarray) -> float:
        return float(x.max())

    before(np.ones(3))  # compiled before watching: not counted
    watch.start()
    watch.start()  # once is enough: not watched twice
    try:
        with caplog.at_level(logging.WARNING, logger="cache_service.host.compiles"):
            late(np.ones(3))
            late(np.ones(3))  # compiled already: nothing more
            before(np.ones(3))
    finally:
        watch.stop()
    assert len(watch.compiled) == 1 and watch.compiled[0].startswith(f"{__name__}.")
    assert metrics.registry.get_sample_value("draftcache_compiles_while_serving_total") == 1.0
    # Only the watch's own records: a thread an earlier test left (a proposer's namespace
    # creation waiting on a service that never came) may log meanwhile.
    (record,) = [r for r in caplog.records if r.name == "cache_service.host.compiles"]
    assert "late" in record.getMessage() and "while serving" in record.getMessage()
    late(np.ones(3, dtype=np.int64))  # a new signature, after stop: not watched
    watch.stop()
    assert len(watch.compiled) == 1

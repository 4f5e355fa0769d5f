"""Shared fixtures: where the real traces, corpora and tokenizers live."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from indexer import kernels

SHARED = Path(os.environ.get("DRAFTCACHE_SHARED", Path(__file__).resolve().parents[2] / "shared"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    data = SHARED / "data"
    if not (data / "traces").is_dir():
        pytest.skip(f"real traces not found under {data} (set DRAFTCACHE_SHARED)")
    return data


def pytest_configure(config: pytest.Config) -> None:
    kernels.prefer_passive_workers()  # as the service does, before any threaded draft step


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, numba) leaves the garbage collector's
    reach, as ``draftcache serve`` does once started. A full collection of the test process
    took 120-180 ms without this and 35-100 ms with it: a pause that lands inside a client
    test with a 10-50 ms deadline turns a served draft into a fallback."""
    gc.collect()
    gc.freeze()

"""Shared fixtures: where the real traces, corpora and tokenizers live."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("DRAFTCACHE_SHARED", Path(__file__).resolve().parents[2] / "shared"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    data = SHARED / "data"
    if not (data / "traces").is_dir():
        pytest.skip(f"real traces not found under {data} (set DRAFTCACHE_SHARED)")
    return data

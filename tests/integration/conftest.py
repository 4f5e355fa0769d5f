"""What the CLI tests share: the Llama-2 tokenizer of the shared data, a small ShareGPT corpus
written on the spot, and a Redis of their own."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_service.config import EmbeddedRedisConfig
from cache_service.host.embedded_redis import EmbeddedRedis


@pytest.fixture
def llama_tokenizer(shared_data: Path) -> Path:
    return shared_data / "tokenizers" / "llama2-spm"


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A Redis of the test's own (embedded, no AOF), stopped after."""
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path / "redis", appendonly=False)).start()
    try:
        yield server.url
    finally:
        server.stop()


def sharegpt(path: Path, texts: list[str]) -> Path:
    """A gzipped ShareGPT corpus at ``path``: one conversation per text, the text its answer."""
    data = [
        {"id": str(i), "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": t}]}
        for i, t in enumerate(texts)
    ]
    with gzip.open(path, "wt") as fh:
        json.dump(data, fh)
    return path

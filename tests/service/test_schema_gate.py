"""``serve`` initialises an empty Redis and refuses a schema it does not know."""

from __future__ import annotations

from pathlib import Path

import pytest

import migrations
from cache_service.app import connect, prepare_schema
from cache_service.config import EmbeddedRedisConfig
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.storage.errors import SchemaMismatch


def test_fresh_is_initialised_newer_is_refused(tmp_path: Path) -> None:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path, appendonly=False)).start()
    try:
        client = connect(server.url)
        # An empty Redis gets the current layout.
        assert prepare_schema(client) == migrations.LATEST
        client.set("draftcache:schema_version", migrations.LATEST + 1)
        # A newer schema (written by a newer build) must not be served by this one.
        with pytest.raises(SchemaMismatch):
            prepare_schema(client)
    finally:
        server.stop()

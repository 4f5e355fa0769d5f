"""Durable state in Redis: lifetime logs, static priors, the namespace registry, sessions.

>>> from cache_service.storage import RedisStore, StoreConfig
>>> StoreConfig().max_log_tokens
16777216
"""

from cache_service.storage.codec import TableItems, decode_table, encode_table
from cache_service.storage.errors import (
    MigrationInProgress,
    NamespaceConflict,
    SchemaMismatch,
    StorageCorrupt,
    StorageError,
    StorageUnavailable,
)
from cache_service.storage.redis_store import RedisStore, StoreConfig
from cache_service.storage.stored_session import StoredSession
from cache_service.storage.stream_log import LogEntry

__all__ = [
    "LogEntry",
    "MigrationInProgress",
    "NamespaceConflict",
    "RedisStore",
    "SchemaMismatch",
    "StorageCorrupt",
    "StorageError",
    "StorageUnavailable",
    "StoreConfig",
    "StoredSession",
    "TableItems",
    "decode_table",
    "encode_table",
]

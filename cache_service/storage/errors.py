"""Typed storage errors. The common ones, and the translation of redis-py exceptions into them,
come from :mod:`migrations.errors` (migrations sit below the service and share them); the store
adds its own kinds here.

The service maps these to gRPC codes: :class:`StorageUnavailable` -> UNAVAILABLE, the rest ->
INTERNAL (or FAILED_PRECONDITION for :class:`SchemaMismatch`, ALREADY_EXISTS for
:class:`NamespaceConflict`).
"""

from __future__ import annotations

from migrations.errors import (
    MigrationInProgress,
    SchemaMismatch,
    StorageCorrupt,
    StorageError,
    StorageUnavailable,
    guarded,
    translate,
)

__all__ = [
    "MigrationInProgress",
    "NamespaceConflict",
    "SchemaMismatch",
    "StorageCorrupt",
    "StorageError",
    "StorageUnavailable",
    "guarded",
    "translate",
]


class NamespaceConflict(StorageError):
    """A namespace is already registered with a different vocabulary size."""

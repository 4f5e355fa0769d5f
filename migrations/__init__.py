"""Redis key-schema versions: an ordered list of idempotent migrations and their runner.

>>> import migrations
>>> from cache_service.storage.connect import connect
>>> print(migrations.run_migrate(connect("redis://127.0.0.1:6379/0"), dry_run=True))  # doctest: +SKIP
schema v0, code v2; would apply:
  v1: initial key layout
  v2: token counters for lifetime logs (cap by tokens)
"""

from __future__ import annotations

from cache_service.storage.clients import StorageClient
from cache_service.storage.errors import guarded
from migrations.base import Migration
from migrations.runner import LATEST, MIGRATIONS, apply, check, migration_lock, plan, stored_version

__all__ = [
    "LATEST",
    "MIGRATIONS",
    "Migration",
    "apply",
    "check",
    "migration_lock",
    "plan",
    "run_migrate",
    "stored_version",
]


@guarded
def run_migrate(client: StorageClient, *, dry_run: bool) -> str:
    """Bring the schema to :data:`LATEST` (or only say what that would take); a report.

    Raises ``SchemaMismatch`` for a newer stored schema, ``MigrationInProgress`` if another
    process is migrating, ``StorageUnavailable`` if Redis cannot be reached.
    """
    stored = stored_version(client)
    pending = plan(client)
    head = f"schema v{stored}, code v{LATEST}"
    if not pending:
        return f"{head}; up to date"
    if dry_run:
        return "\n".join([f"{head}; would apply:", *(f"  {m}" for m in pending)])
    applied = apply(client)
    lines = [f"{head}; applied:", *(f"  {m}" for m in applied)]
    return "\n".join([*lines, f"schema now v{stored_version(client)}"])

"""Redis key-schema versions: an ordered list of idempotent migrations and their runner.

Migrations import nothing of the service (redis-py only): the service imports them.

>>> import migrations
>>> import redis
>>> print(migrations.run_migrate(redis.Redis(), dry_run=True))  # doctest: +SKIP
schema v0, code v3; would apply:
  v1: initial key layout
  v2: token counters for lifetime logs (cap by tokens)
  v3: session dynamic-table keys dropped (never read)
"""

from __future__ import annotations

from migrations.base import Migration
from migrations.clients import Client
from migrations.errors import MigrationInProgress, SchemaMismatch, StorageError, guarded
from migrations.runner import LATEST, MIGRATIONS, apply, check, migration_lock, plan, stored_version

__all__ = [
    "LATEST",
    "MIGRATIONS",
    "Migration",
    "MigrationInProgress",
    "SchemaMismatch",
    "StorageError",
    "apply",
    "check",
    "migration_lock",
    "plan",
    "run_migrate",
    "stored_version",
]


@guarded
def run_migrate(client: Client, *, dry_run: bool) -> str:
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

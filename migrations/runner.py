"""Plan, apply and check key-schema migrations.

The schema version is one integer under ``draftcache:schema_version`` (absent means 0, an empty
database). ``apply`` holds a ``SET NX PX`` lock so two replicas never migrate at once, and
records each step's version only while it still holds the lock. The lock is renewed while its
holder lives, however long a step takes on a large dataset; a holder that died leaves it to
expire within ``LOCK_TTL_MS``.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from redis import exceptions as rexc

from migrations import keys, v001_initial, v002_log_token_counts, v003_drop_session_dyn
from migrations.base import Migration
from migrations.clients import Client
from migrations.errors import MigrationInProgress, SchemaMismatch, StorageCorrupt, guarded

logger = logging.getLogger(__name__)

MIGRATIONS: tuple[Migration, ...] = (
    v001_initial.MIGRATION,
    v002_log_token_counts.MIGRATION,
    v003_drop_session_dyn.MIGRATION,
)
LATEST = MIGRATIONS[-1].version
LOCK_TTL_MS = 15_000  # renewed every third of it: how long a dead migrator's lock blocks the next

# Record a step and extend the lock, only if the lock is still ours (a fencing check).
_RECORD_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _check_sequence(migrations: Sequence[Migration]) -> None:
    if [m.version for m in migrations] != list(range(1, len(migrations) + 1)):
        raise ValueError(f"migrations must be numbered 1..n in order, got {[m.version for m in migrations]}")


@guarded
def stored_version(client: Client) -> int:
    """The schema version recorded in Redis; 0 for a database draftcache never touched."""
    raw = client.get(keys.SCHEMA_VERSION)
    if raw is None:
        return 0
    try:
        version = int(raw)
    except ValueError as exc:
        raise StorageCorrupt(f"{keys.SCHEMA_VERSION} holds {raw!r}, not an integer") from exc
    if version < 0:
        raise StorageCorrupt(f"{keys.SCHEMA_VERSION} holds a negative version {version}")
    return version


def _refuse_newer(stored: int, migrations: Sequence[Migration]) -> None:
    latest = migrations[-1].version if migrations else 0
    if stored > latest:
        raise SchemaMismatch(
            f"Redis holds key schema v{stored}, newer than this build knows (v{latest}); upgrade draftcache",
            stored=stored,
            expected=latest,
        )


@guarded
def plan(client: Client, migrations: Sequence[Migration] = MIGRATIONS) -> list[Migration]:
    """The migrations ``apply`` would run, in order (a dry run: writes nothing).

    >>> [str(m) for m in plan(connect("redis://127.0.0.1:6379/0"))]  # doctest: +SKIP
    ['v1: initial key layout', 'v2: token counters for lifetime logs (cap by tokens)', 'v3: ...']
    """
    _check_sequence(migrations)
    stored = stored_version(client)
    _refuse_newer(stored, migrations)
    return [m for m in migrations if m.version > stored]


@contextmanager
def migration_lock(client: Client, ttl_ms: int = LOCK_TTL_MS) -> Iterator[str]:
    """Hold the migration lock; yields this holder's token. Raises :class:`MigrationInProgress`.

    While it is held a thread renews it every third of ``ttl_ms``, until it is released or
    found taken by another (the step's record then fails its fencing check).
    """
    token = uuid.uuid4().hex
    if not client.set(keys.MIGRATION_LOCK, token, nx=True, px=ttl_ms):
        raise MigrationInProgress(f"another process holds {keys.MIGRATION_LOCK}; {_held_for(client)}")
    stop = threading.Event()
    keeper = threading.Thread(target=_keep, args=(client, token, ttl_ms, stop), name="migration-lock", daemon=True)
    keeper.start()
    try:
        yield token
    finally:
        stop.set()
        keeper.join()
        client.register_script(_RELEASE_LUA)(keys=[keys.MIGRATION_LOCK], args=[token])


def _held_for(client: Client) -> str:
    """What to do about a lock another process holds: when it frees if that process died."""
    left = client.pttl(keys.MIGRATION_LOCK)
    if left == -1:  # set by hand, or by a build that did not expire it
        return "it has no expiry: delete it if no migration is running"
    if left > 0:
        return f"retry when it is done (if it died, the lock expires in {math.ceil(left / 1000)} s)"
    return "retry when it is done"


def _keep(client: Client, token: str, ttl_ms: int, stop: threading.Event) -> None:
    """Renew the lock while ``stop`` is unset and the lock is still ``token``'s."""
    renew = client.register_script(_RENEW_LUA)
    while not stop.wait(ttl_ms / 3000):
        try:
            if not renew(keys=[keys.MIGRATION_LOCK], args=[token, ttl_ms]):
                return
        except (rexc.RedisError, rexc.RedisClusterException) as exc:  # try again; the record fences
            logger.warning("could not renew %s: %s", keys.MIGRATION_LOCK, exc)


@guarded
def apply(
    client: Client, migrations: Sequence[Migration] = MIGRATIONS, *, lock_ttl_ms: int = LOCK_TTL_MS
) -> list[Migration]:
    """Run every pending migration in order; returns those applied (``[]`` when up to date).

    ``lock_ttl_ms``: how long the lock outlives this process should it die (it is renewed
    while the steps run).
    """
    _check_sequence(migrations)
    record = client.register_script(_RECORD_LUA)
    applied: list[Migration] = []
    with migration_lock(client, lock_ttl_ms) as token:
        for migration in plan(client, migrations):  # planned under the lock: nobody else moves it
            logger.info("applying schema migration %s", migration)
            migration.apply(client)
            fence = [keys.MIGRATION_LOCK, keys.SCHEMA_VERSION]
            if not record(keys=fence, args=[token, migration.version, lock_ttl_ms]):
                raise MigrationInProgress(f"lost {keys.MIGRATION_LOCK} while applying {migration}; run migrate again")
            applied.append(migration)
    return applied


@guarded
def check(client: Client, migrations: Sequence[Migration] = MIGRATIONS) -> int:
    """Return the stored schema version if this build serves it, else raise :class:`SchemaMismatch`.

    A newer stored version means an older build must not write to it; an older one means
    ``draftcache migrate`` has not been run yet.
    """
    _check_sequence(migrations)
    stored = stored_version(client)
    _refuse_newer(stored, migrations)
    latest = migrations[-1].version if migrations else 0
    if stored < latest:
        raise SchemaMismatch(
            f"Redis holds key schema v{stored}, this build needs v{latest}; run `draftcache migrate`",
            stored=stored,
            expected=latest,
        )
    return stored

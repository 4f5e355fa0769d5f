"""The errors of everything that talks to draftcache's Redis, and the one place where redis-py
exceptions become them.

They live here, at the bottom, because migrations run before anything else touches Redis and
import nothing of the service; :mod:`cache_service.storage.errors` re-exports them (adding the
store's own kinds), so a caller catching :class:`StorageError` catches a migration's errors too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from redis import exceptions as rexc

P = ParamSpec("P")
R = TypeVar("R")

# Errors that mean "Redis cannot answer right now" rather than "the request or the data is wrong":
# a dead or slow server, a replica that is still loading its dataset, a failover in progress.
_UNAVAILABLE: tuple[type[Exception], ...] = (
    rexc.ConnectionError,  # includes BusyLoadingError (server loading its RDB/AOF)
    rexc.TimeoutError,
    rexc.ReadOnlyError,  # we are talking to a replica after a failover
    rexc.ClusterDownError,
    rexc.TryAgainError,
    rexc.MasterDownError,
)


class StorageError(Exception):
    """Base class of every error raised by ``migrations`` and ``cache_service.storage``."""


class StorageUnavailable(StorageError):
    """Redis could not be reached or could not answer in time; retrying later may succeed."""


class StorageCorrupt(StorageError):
    """Stored data does not decode: wrong type, bad length, checksum mismatch, missing part."""


class SchemaMismatch(StorageError):
    """The stored key-schema version is not the one this code serves.

    ``stored`` is the version found in Redis (0 when none), ``expected`` the one the code knows.
    """

    def __init__(self, message: str, *, stored: int, expected: int) -> None:
        super().__init__(message)
        self.stored = stored
        self.expected = expected


class MigrationInProgress(StorageError):
    """Another process holds the migration lock (or this one lost it)."""


def translate(exc: rexc.RedisError | rexc.RedisClusterException) -> StorageError | None:
    """The storage error for a redis-py exception, or ``None`` when it is a bug to re-raise.

    A cluster client also raises ``RedisClusterException`` (not a ``RedisError``): when no
    node owns a slot, or when no seed node answered while it (re)learned the slots.

    >>> type(translate(rexc.TimeoutError("slow"))).__name__
    'StorageUnavailable'
    >>> type(translate(rexc.ResponseError("WRONGTYPE Operation against a key"))).__name__
    'StorageCorrupt'
    >>> type(translate(rexc.ResponseError("MISCONF Errors writing to the AOF file"))).__name__
    'StorageUnavailable'
    >>> type(translate(rexc.ResponseError("NOREPLICAS Not enough good replicas to write."))).__name__
    'StorageUnavailable'
    """
    if isinstance(exc, _UNAVAILABLE):
        return StorageUnavailable(f"redis unavailable: {exc}")
    if isinstance(exc, rexc.SlotNotCoveredError) or (
        isinstance(exc, rexc.RedisClusterException) and isinstance(exc.__cause__, _UNAVAILABLE)
    ):
        return StorageUnavailable(f"redis cluster unavailable: {exc}")
    if isinstance(exc, rexc.OutOfMemoryError) or _refuses_writes(exc):
        return StorageUnavailable(f"redis refuses writes: {exc}")
    if isinstance(exc, rexc.ResponseError) and str(exc).startswith(("WRONGTYPE", "CORRUPT")):
        return StorageCorrupt(str(exc))
    return None


def _refuses_writes(exc: Exception) -> bool:
    """Redis refusing writes until an operator (or free space, or a replica) fixes it: it cannot
    persist (MISCONF: a failed RDB save, often a full disk), is out of memory (OOM, also when a
    script runs into it) or has fewer replicas in reach than ``min-replicas-to-write`` asks."""
    text = str(exc)
    refusals = ("MISCONF", "OOM command not allowed", "NOREPLICAS")
    return isinstance(exc, rexc.ResponseError) and any(r in text for r in refusals)


def guarded(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a Redis call so redis-py errors surface as :class:`StorageError` subclasses."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (rexc.RedisError, rexc.RedisClusterException) as exc:
            mapped = translate(exc)
            if mapped is None:
                raise
            raise mapped from exc

    return wrapper

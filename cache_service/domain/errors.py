"""Domain errors: what a client can be told went wrong. The service raises these (a
``ValueError`` from the indexer's checks of client input becomes :class:`InvalidArgument` where
the service calls it); the one error interceptor maps them to gRPC status codes."""

from __future__ import annotations


class DraftCacheError(Exception):
    """Base of every error a client can be told about."""


class InvalidArgument(DraftCacheError, ValueError):
    """The request itself is wrong: bad ids, budgets, shapes, names."""


class NotFound(DraftCacheError):
    """An unknown (or closed, or expired) session or namespace."""


class AlreadyExists(DraftCacheError):
    """A namespace created twice with different settings."""


class ResourceExhausted(DraftCacheError):
    """A limit was reached: batch size, message size, sessions per tenant."""


class Unavailable(DraftCacheError):
    """A dependency (storage) cannot be reached; retrying later may succeed."""


class FailedPrecondition(DraftCacheError):
    """The system is not in a state to serve this (e.g. an unknown newer storage schema)."""


class Unauthenticated(DraftCacheError):
    """No credentials, or credentials nobody issued."""


class PermissionDenied(DraftCacheError):
    """Known caller, but not allowed this call or this namespace."""


def unknown_session(sid: str) -> NotFound:
    """The one answer for a session a caller may not see: unknown, expired, closed or another
    tenant's alike (so existence is never told). A long id is cut, not echoed whole.

    >>> str(unknown_session("x" * 300))[:40]
    "unknown or expired session 'xxxxxxxxxxxx"
    >>> str(unknown_session("x" * 300)).endswith("...' (300 characters)")
    True
    """
    shown = sid if len(sid) <= 80 else f"{sid[:64]}...' ({len(sid)} characters)"
    return NotFound(f"unknown or expired session '{shown}" + ("'" if len(sid) <= 80 else ""))

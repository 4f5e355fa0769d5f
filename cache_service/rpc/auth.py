"""Who is calling: bearer tokens mapped to tenants, roles and the namespaces they may use.

A token file (JSON) lists the tokens; each belongs to a tenant, has a role (``decoder``: the
drafting calls; ``admin``: also the admin calls) and may be limited to some namespaces. Tokens
may be given as their SHA-256 (``"token_sha256"``) so the file need not hold secrets::

    {"tokens": [
        {"token": "s3cret", "tenant": "acme", "role": "decoder", "namespaces": ["acme-llama"]},
        {"token_sha256": "9f86...", "tenant": "ops", "role": "admin"}],
     "limits": {"acme": {"max_sessions": 1000, "max_session_tokens": 4000000}}}

Without a token file every caller is trusted (the local default). Health and reflection never
need a token (probes).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import grpc

from cache_service.domain.errors import PermissionDenied, Unauthenticated
from cache_service.domain.tenants import Principal, Role, TenantLimits

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
ADMIN_PREFIX = "/draftcache.v1.Admin/"


@dataclass(frozen=True)
class TokenTable:
    """SHA-256 of each token -> its principal."""

    by_digest: dict[str, Principal]

    def principal(self, token: str) -> Principal | None:
        digest = _digest(token)
        for known, principal in self.by_digest.items():  # constant time per comparison
            if hmac.compare_digest(known, digest):
                return principal
        return None

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Parse a token file; ``ValueError`` says what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable token file: {exc}") from exc
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "token file") -> TokenTable:
        if not isinstance(data, dict) or not isinstance(data.get("tokens"), list) or not data["tokens"]:
            raise ValueError(f"{where}: expected {{'tokens': [...]}} with at least one token")
        given = data.get("limits", {})
        if not isinstance(given, dict):
            raise ValueError(f"{where}: limits must be an object of tenant -> limits")
        limits = {str(t): _limits(v, f"{where}: limits[{t!r}]") for t, v in given.items()}
        table: dict[str, Principal] = {}
        for i, entry in enumerate(data["tokens"]):
            digest, principal = _entry(entry, limits, f"{where}: tokens[{i}]")
            if digest in table:
                raise ValueError(f"{where}: tokens[{i}] repeats an earlier token")
            table[digest] = principal
        return cls(table)


def _entry(entry: Any, limits: dict[str, TenantLimits], where: str) -> tuple[str, Principal]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object")
    if ("token" in entry) == ("token_sha256" in entry):
        raise ValueError(f"{where}: give exactly one of token or token_sha256")
    digest = _digest(str(entry["token"])) if "token" in entry else str(entry["token_sha256"]).lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"{where}: token_sha256 must be 64 hex digits")
    tenant = str(entry.get("tenant", ""))
    if not tenant:
        raise ValueError(f"{where}: a tenant is required")
    try:
        role = Role(entry.get("role", "decoder"))
    except ValueError as exc:
        raise ValueError(f"{where}: role must be decoder or admin") from exc
    names = entry.get("namespaces")
    namespaces = None if names is None else frozenset(str(n) for n in _list(names, where))
    return digest, Principal(tenant, role, namespaces, limits.get(tenant, TenantLimits()))


def _limits(value: Any, where: str) -> TenantLimits:
    """A tenant's limits, each a whole number >= 0.

    >>> _limits({"max_sessions": 4}, "t")
    TenantLimits(max_sessions=4, max_session_tokens=0)
    >>> _limits({"max_sesions": 4}, "t")
    Traceback (most recent call last):
    ValueError: t: unknown limit 'max_sesions' (known: max_session_tokens, max_sessions)
    """
    known = {f.name for f in fields(TenantLimits)}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object of limits")
    for name, number in value.items():
        if name not in known:
            raise ValueError(f"{where}: unknown limit {name!r} (known: {', '.join(sorted(known))})")
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(f"{where}: {name} must be a whole number >= 0, got {number!r}")
    return TenantLimits(**value)


def _list(value: Any, where: str) -> Iterable[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: namespaces must be a list")
    return value


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# The caller of the request being handled (None when authentication is off).
_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("draftcache_principal", default=None)


def current() -> Principal | None:
    return _current.get()


def authenticate(tokens: TokenTable, method: str, metadata: Iterable[tuple[str, Any]]) -> Principal | None:
    """The principal for a call to ``method`` with ``metadata``; ``None`` for open methods."""
    if method.startswith(OPEN_PREFIXES):
        return None
    header = next((str(v) for k, v in metadata if k == "authorization"), "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer <token>')")
    principal = tokens.principal(token.strip())
    if principal is None:
        raise Unauthenticated("unknown bearer token")
    if method.startswith(ADMIN_PREFIX) and principal.role is not Role.ADMIN:
        raise PermissionDenied(f"tenant {principal.tenant!r}: admin calls need an admin token")
    return principal


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call and makes its principal :func:`current` while it is handled.
    Failures are raised as domain errors, mapped to status codes by the error interceptor."""

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method, tokens = details.method, self._tokens
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                _current.set(authenticate(tokens, method, context.invocation_metadata() or ()))
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                _current.set(authenticate(tokens, method, context.invocation_metadata() or ()))
                async for response in inner_stream(requests, context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        raise NotImplementedError(f"{method}: no authentication for this kind of method")

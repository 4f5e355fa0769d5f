"""Who a call belongs to, as the domain sees it: a tenant, its role, the namespaces it may use
and its limits. How a caller proves it is :mod:`cache_service.rpc.auth`'s business.

>>> p = Principal(tenant="acme", role=Role.DECODER, namespaces=frozenset({"acme-llama"}))
>>> p.may_use("acme-llama"), p.may_use("other")
(True, False)
>>> owns(p, "acme", "acme-llama"), owns(p, "other-tenant", "acme-llama"), owns(None, "", "any")
(True, False, True)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cache_service.domain.errors import PermissionDenied


class Role(enum.Enum):
    DECODER = "decoder"
    ADMIN = "admin"


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    max_sessions: int = 0  # 0: only the service-wide limit
    max_session_tokens: int = 0  # context tokens held by the tenant's open sessions; 0: no limit

    def __post_init__(self) -> None:
        if self.max_sessions < 0 or self.max_session_tokens < 0:
            raise ValueError("tenant limits must be >= 0")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    tenant: str
    role: Role
    namespaces: frozenset[str] | None = None  # None: every namespace
    limits: TenantLimits = field(default_factory=TenantLimits)

    def may_use(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces

    def check_namespace(self, namespace: str) -> None:
        if not self.may_use(namespace):
            raise PermissionDenied(f"tenant {self.tenant!r} may not use namespace {namespace!r}")


def tenant_of(principal: Principal | None) -> str:
    """The tenant a call acts for: ``""`` when callers are not authenticated."""
    return "" if principal is None else principal.tenant


def owns(principal: Principal | None, tenant: str, namespace: str) -> bool:
    """Whether the caller may use (and so know of) a session of ``tenant`` in ``namespace``:
    sessions belong to the tenant that opened them, wherever they are held, and the caller's
    token must still allow the namespace. Anything else is answered as an unknown session."""
    return tenant == tenant_of(principal) and (principal is None or principal.may_use(namespace))

"""What a migration is: a numbered, described, idempotent change to the key schema."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from migrations.clients import Client


@dataclass(frozen=True, kw_only=True)
class Migration:
    """Step from schema ``version - 1`` to ``version``.

    ``apply`` must be idempotent: a runner that dies after ``apply`` but before recording the
    new version runs it again.

    >>> Migration(version=1, description="initial layout", apply=lambda client: None).version
    1
    """

    version: int
    description: str
    apply: Callable[[Client], None]

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ValueError(f"migration version must be >= 1, got {self.version}")
        if not self.description:
            raise ValueError("migration description must not be empty")

    def __str__(self) -> str:
        return f"v{self.version}: {self.description}"

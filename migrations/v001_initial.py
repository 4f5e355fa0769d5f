"""v1: the initial key layout (layout ``v1``).

Namespace registry hash, per-namespace lifetime log streams capped by entry count, chunked
priors, session keys. Nothing needs creating: recording version 1 is the whole step.
"""

from __future__ import annotations

from migrations.base import Migration
from migrations.clients import Client


def apply(client: Client) -> None:
    """Nothing to create: every v1 key is made on first write."""


MIGRATION = Migration(version=1, description="initial key layout", apply=apply)

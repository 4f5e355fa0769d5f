"""v1: the initial key layout (``cache_service.storage.keys``, layout ``v1``).

Namespace registry hash, per-namespace lifetime log streams capped by entry count, chunked
priors, session keys. Nothing needs creating: recording version 1 is the whole step.
"""

from __future__ import annotations

from cache_service.storage.clients import StorageClient
from migrations.base import Migration


def apply(client: StorageClient) -> None:
    """Nothing to create: every v1 key is made on first write."""


MIGRATION = Migration(version=1, description="initial key layout", apply=apply)

"""v1: the initial key layout (``cache_service.storage.keys``, layout ``v1``).

Namespace registry hash, per-namespace lifetime log streams capped by entry count, chunked
priors, session keys. Nothing needs creating: recording version 1 is the whole step.
"""

from __future__ import annotations

import redis

from migrations.base import Migration


def apply(client: redis.Redis) -> None:
    """Nothing to create: every v1 key is made on first write."""


MIGRATION = Migration(version=1, description="initial key layout", apply=apply)

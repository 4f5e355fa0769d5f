"""What the domain needs of durable storage, and what storage hands back. The service never
waits on it while serving draft or feedback calls; it is called for opens of sessions held
elsewhere (off the serving thread), namespace creation and commits."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from cache_service.storage.stored_session import StoredSession
from indexer.lifetime_index import LogId

# Commits written to a namespace's lifetime log: the namespace, the requests, their positions.
Logged = tuple[str, list[np.ndarray], list[LogId]]


class Persistence(Protocol):
    """Where durable effects go (Redis in production). It holds nothing of the service: it
    takes and returns data, and the caller applies what comes back."""

    @property
    def pending(self) -> int:
        """Commits accepted but not yet written (storage slow or down)."""
        ...

    def load_session(self, sid: str) -> StoredSession | None: ...

    def namespace_created(self, name: str, vocab_size: int) -> None: ...

    def requests_committed(self, namespace: str, requests: list[np.ndarray]) -> list[Logged]:
        """Queue commits and write what storage takes now; returns what was written (queued
        commits of other calls included), for the caller to mark where they fall in the log."""
        ...

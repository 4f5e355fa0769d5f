"""What the domain needs of durable storage, and what storage hands back. The service never
waits on it while serving draft or feedback calls; it is called for opens of sessions held
elsewhere (off the serving thread), namespace creation and commits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from cache_service.storage.stored_session import StoredSession
from indexer.lifetime_index import LogId

# Commits written to a namespace's lifetime log: the namespace, the requests, their positions.
Logged = tuple[str, list[np.ndarray], list[LogId]]


class Requests(NamedTuple):
    """Log entries read into a memory: their tokens and positions, and the commit keys of
    every entry the memory now holds from the read, those taken here and those it held already
    (indexed in an adopted generation, or journaled here); none of this process's own."""

    tokens: list[np.ndarray]
    ids: list[LogId]
    keys: list[str]


class Committed(NamedTuple):
    """What became of one call's commits: what was written to logs (other calls' queued commits
    included), and per commit whether the log held it already (a client's retry of a commit
    that landed: acknowledged, not appended). A commit journaled is not known to be held."""

    logged: list[Logged]
    repeated: list[bool]


class Persistence(Protocol):
    """Where durable effects go (Redis in production). It holds nothing of the service: it
    takes and returns data, and the caller applies what comes back."""

    @property
    def pending(self) -> int:
        """Commits accepted but not yet written (storage slow or down)."""
        ...

    def load_session(self, sid: str) -> StoredSession | None: ...

    def sessions_ended(self, sids: list[str]) -> None:
        """Sessions closed here: their stored copies deleted now, within the call timeout, so
        that no replica continues them; nothing when storage does not answer (the write-back
        deletes them later)."""
        ...

    def namespace_created(self, name: str, vocab_size: int) -> None: ...

    def tokenizer_claimed(self, name: str, fingerprint: str) -> str:
        """Record ``fingerprint`` as the namespace's tokenizer unless one is recorded already;
        the one recorded now."""
        ...

    def namespace_deleted(self, name: str) -> bool:
        """Remove everything storage keeps of the namespace (registration, lifetime log, priors,
        stored sessions); whether it was registered."""
        ...

    def namespace_forgotten(self, name: str) -> None:
        """The namespace was deleted elsewhere: nothing kept of it here is to be written."""
        ...

    def requests_committed(self, namespace: str, requests: list[np.ndarray], keys: Sequence[str] = ()) -> Committed:
        """Queue commits, each with the key its client named it with ("": none), and write what
        storage takes now; returns what was written (queued commits of other calls included),
        for the caller to mark where they fall in the log, and which the log held already."""
        ...

    def log_after(self, ns: str, after: str, max_tokens: int) -> tuple[list[tuple[str, np.ndarray]], str]:
        """Log entries after the entry ``after`` (empty: none, from the log's end now), of at
        most ``max_tokens`` tokens in all but at least one; and the id to read on after."""
        ...

    def prior_page(self, ns: str, version: int, offset: int, max_bytes: int) -> PriorPage | None:
        """At most ``max_bytes`` of the blob of prior ``version`` of ``ns`` (0: the current one)
        from ``offset``; ``None`` where the namespace has no such version (none published, or
        dropped by later publishes)."""
        ...


@dataclass(frozen=True, kw_only=True)
class PriorPage:
    """A page of a static prior's stored blob (``StaticPrior.to_bytes()``), for a decoder's
    near copy: which version, the whole blob's size and blake2b-256 digest (hex), and the page."""

    version: int
    size: int
    digest: str
    data: bytes


@dataclass(frozen=True, kw_only=True)
class StorageHealth:
    """Where storage stands, as the service sees it (an operator's first look after a fault)."""

    available: bool = True  # the last write reached storage
    last_error: str = ""  # why the last failed write failed
    unavailable_seconds: float = 0.0  # since storage became unreachable (0 while available)
    journaled_commits: int = 0  # acknowledged commits held in the local journal, not yet stored
    journal_bytes: int = 0
    journal_capacity_bytes: int = 0
    disk_full: bool = False  # the last failure was a full disk (storage's or the journal's)
    embedded_restarts: int = 0  # times the embedded Redis was restarted after it died
    repeated_commits: int = 0  # commits not appended: the log held them already (retries)

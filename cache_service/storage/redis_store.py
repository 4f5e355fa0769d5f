"""``RedisStore``: everything draftcache keeps in Redis, behind one small API.

The store takes a ready client (built at the entry point by
:func:`cache_service.storage.connect.connect`: one Redis, a Sentinel master or a Redis Cluster,
with ``decode_responses=False``, socket timeouts and a bounded retry policy) and raises only
:mod:`cache_service.storage.errors` types for Redis trouble. It assumes the key schema is
current: entry points run ``migrations.check(client)`` before serving.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cache_service.storage import codec, keys, priors, sessions, stream_log, successors
from cache_service.storage import namespaces as stored_namespaces
from cache_service.storage.clients import StorageClient
from cache_service.storage.errors import NamespaceConflict, StorageCorrupt, guarded
from cache_service.storage.stored_session import StoredSession
from cache_service.storage.stream_log import LogEntry
from indexer.fingerprint import check_fingerprint
from indexer.tokens import MAX_VOCAB_SIZE

MiB = 1 << 20
# Redis rejects bulk strings above proto-max-bulk-len (512 MB by default); parts stay far below.
MAX_PART_BYTES = 512 * MiB


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Sizes and limits of the store.

    >>> StoreConfig(max_log_tokens=1 << 20).prior_part_bytes == 64 * MiB
    True
    """

    max_log_tokens: int = 16 << 20  # per namespace, the lifetime buffer's capacity
    # How long a log remembers the commit numbers of a writer that stopped appending: a journal
    # replayed later than this after an uncertain append may add that append's commits twice.
    writer_ttl_s: int = 30 * 24 * 3600
    # How long, and how many of its latest, the commit keys clients name commits with a log
    # keeps: a client's retry of a commit that landed is skipped if it lands within both.
    commit_key_ttl_s: int = 24 * 3600
    max_commit_keys: int = 1 << 17
    prior_part_bytes: int = 64 * MiB
    prior_staging_ttl_s: int = 3600  # an unpublished upload disappears after this
    read_batch: int = 1024  # log entries per read, keys per SCAN step

    def __post_init__(self) -> None:
        if self.max_log_tokens < 1:
            raise ValueError(f"max_log_tokens must be >= 1, got {self.max_log_tokens}")
        if not 1 <= self.prior_part_bytes <= MAX_PART_BYTES:
            raise ValueError(f"prior_part_bytes must be in [1, {MAX_PART_BYTES}], got {self.prior_part_bytes}")
        if self.prior_staging_ttl_s < 1:
            raise ValueError(f"prior_staging_ttl_s must be >= 1, got {self.prior_staging_ttl_s}")
        if self.read_batch < 1:
            raise ValueError(f"read_batch must be >= 1, got {self.read_batch}")
        if self.writer_ttl_s < 1:
            raise ValueError(f"writer_ttl_s must be >= 1, got {self.writer_ttl_s}")
        if self.commit_key_ttl_s < 1 or self.max_commit_keys < 1:
            got = f"{self.commit_key_ttl_s} and {self.max_commit_keys}"
            raise ValueError(f"commit_key_ttl_s and max_commit_keys must be >= 1, got {got}")


class RedisStore:
    """Lifetime logs, priors, the namespace registry and session copies in one Redis (or cluster).

    >>> store = RedisStore(connect("redis://127.0.0.1:6379/0"))  # doctest: +SKIP
    >>> store.append_requests("llama2", [np.array([5, 6, 7], np.int32)])  # doctest: +SKIP
    ['1718000000000-0']
    >>> [e.tokens.tolist() for e in store.read_log("llama2")]  # doctest: +SKIP
    [[5, 6, 7]]
    """

    def __init__(self, client: StorageClient, config: StoreConfig | None = None) -> None:
        settings = client.get_connection_kwargs() if hasattr(client, "get_connection_kwargs") else {}
        if settings.get("decode_responses"):
            raise ValueError("RedisStore needs a client with decode_responses=False (it stores raw bytes)")
        self.client = client
        self.config = config or StoreConfig()
        self._append = client.register_script(stream_log.APPEND_LUA)
        self._append_once = client.register_script(stream_log.APPEND_ONCE_LUA)
        self._save_sessions = client.register_script(sessions.SAVE_LUA)
        self._append_sessions = client.register_script(sessions.APPEND_LUA)

    @guarded
    def ping(self) -> float:
        """Round-trip time to Redis in seconds; :class:`StorageUnavailable` if it does not answer."""
        start = time.perf_counter()
        self.client.ping()
        return time.perf_counter() - start

    # -- namespaces -------------------------------------------------------------------------

    @guarded
    def register_namespace(self, name: str, vocab_size: int) -> bool:
        """Record ``name -> vocab_size``; ``True`` if new, ``False`` if already registered alike.

        Raises :class:`NamespaceConflict` if ``name`` is registered with another vocabulary size.
        """
        keys.check_name(name, what="namespace")
        if isinstance(vocab_size, bool) or not 1 <= vocab_size <= MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {vocab_size!r}")
        # HSETNX never overwrites, so a value read after a failed HSETNX is final.
        if self.client.hsetnx(keys.NAMESPACES, name, int(vocab_size)):
            return True
        stored = self.namespaces().get(name)
        if stored != vocab_size:
            raise NamespaceConflict(f"namespace {name!r} is registered with vocab_size {stored}, not {vocab_size}")
        return False

    @guarded
    def claim_tokenizer(self, name: str, fingerprint: str) -> str:
        """Record ``fingerprint`` as the namespace's tokenizer unless one is recorded already;
        the one recorded now (``fingerprint`` where it was the first)."""
        check_fingerprint(fingerprint)
        key = keys.tokenizer(keys.check_name(name, what="namespace"))
        # SET NX never overwrites, so a value read after a refused SET NX is final.
        if self.client.set(key, fingerprint, nx=True):
            return fingerprint
        return self._fingerprint(key, self.client.get(key))

    @guarded
    def tokenizers(self, names: list[str]) -> dict[str, str]:
        """Each namespace's recorded tokenizer fingerprint ("" where none is), in one round trip."""
        found = self._get_each([keys.tokenizer(ns) for ns in names])
        return {ns: self._fingerprint(keys.tokenizer(ns), raw) for ns, raw in zip(names, found, strict=True)}

    @staticmethod
    def _fingerprint(key: str, raw: object) -> str:
        if raw is None:
            return ""
        try:
            return check_fingerprint(raw.decode() if isinstance(raw, bytes) else str(raw))
        except (UnicodeDecodeError, ValueError) as exc:
            raise StorageCorrupt(f"{key} is not a tokenizer fingerprint: {exc}") from exc

    @guarded
    def delete_namespace(self, name: str) -> stored_namespaces.Deleted:
        """Remove the namespace's registration, every key of it and its stored sessions (SCAN,
        a batch of ``config.read_batch`` keys at a time); calling it again finishes an
        interrupted deletion."""
        return stored_namespaces.delete(self.client, name, self.config.read_batch)

    @guarded
    def namespace_registered(self, name: str) -> bool:
        """Whether ``name`` is registered (one HEXISTS)."""
        return bool(self.client.hexists(keys.NAMESPACES, keys.check_name(name, what="namespace")))

    @guarded
    def namespaces(self) -> dict[str, int]:
        """Every registered namespace and its vocabulary size."""
        fields = codec.as_fields(self.client.hgetall(keys.NAMESPACES), what=keys.NAMESPACES)
        try:
            return {k.decode(): int(v) for k, v in fields.items()}
        except (UnicodeDecodeError, ValueError) as exc:
            raise StorageCorrupt(f"{keys.NAMESPACES} does not decode: {exc!r}") from exc

    # -- lifetime log -----------------------------------------------------------------------

    @guarded
    def append_requests(self, ns: str, requests: list[np.ndarray], *, max_tokens: int | None = None) -> list[str]:
        """Append finished requests (1-D int32 arrays, ids already validated) to the log.

        Returns one stream id per request. Afterwards the log holds at most ``max_tokens``
        tokens (default ``config.max_log_tokens``): the oldest entries are dropped whole, and a
        request longer than the cap keeps only its last ``max_tokens`` tokens. Separators are
        not stored and not counted. Append, trim and the token counter update are atomic.
        """
        cap = self.config.max_log_tokens if max_tokens is None else max_tokens
        if cap < 1:
            raise ValueError(f"max_tokens must be >= 1, got {cap}")
        for tokens in requests:
            if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.ndim != 1:
                raise ValueError("every request must be a 1-D int32 numpy array")
        if not requests:
            return []
        return stream_log.append(self._append, ns, requests, cap)

    @guarded
    def append_commits(
        self,
        ns: str,
        commits: Sequence[stream_log.Commit | tuple[bytes, int, np.ndarray]],
        *,
        log: str = "",
        replicas: int = 0,
        wait_ms: int = 0,
    ) -> list[str | None]:
        """Append commits identified by ``(writer, seq)``, each writer's in increasing ``seq``,
        skipping those the log already took (an append whose answer was lost, replayed from a
        journal; or one whose client-named key the log recorded within ``commit_key_ttl_s``
        and ``max_commit_keys``: a client's retry): per commit its stream id, or ``None`` when
        skipped. Trims as :meth:`append_requests` does, atomically with the appends. ``log``:
        the identity of the log (:meth:`log_identity`) they were made for;
        :class:`~.stream_log.LogReplaced`, and nothing appended, when the namespace's log is
        another one now ("": not checked). With ``replicas``, the appends are waited for (at
        most ``wait_ms``) until that many replicas have them: :class:`~.stream_log.NotReplicated`
        when fewer did."""
        checked = [stream_log.Commit(*c) for c in commits]
        for writer, seq, tokens, key in checked:
            if len(writer) != 16 or seq < 0:
                raise ValueError("a commit is a 16-byte writer id and a seq >= 0")
            if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.ndim != 1:
                raise ValueError("every request must be a 1-D int32 numpy array")
            if not isinstance(key, str) or len(key) > stream_log.MAX_KEY_LEN or not key.isascii():
                raise ValueError(f"a commit key is at most {stream_log.MAX_KEY_LEN} ASCII characters")
        if not checked:
            return []
        cfg = self.config
        wait = (self.client, replicas, wait_ms) if replicas else None
        window = stream_log.KeyWindow(cfg.commit_key_ttl_s * 1000, cfg.max_commit_keys)
        return stream_log.append_once(
            self._append_once, ns, checked, cfg.max_log_tokens, cfg.writer_ttl_s, log, window=window, replicas=wait
        )

    @guarded
    def read_log(self, ns: str, after_id: str = "0", count: int | None = None) -> list[LogEntry]:
        """Up to ``count`` entries (default ``config.read_batch``) after ``after_id``, oldest first.

        Page through the whole log by passing the last id back until the answer is empty; the
        arrays are read-only int32 views.
        """
        return stream_log.read(self.client, ns, after_id, count or self.config.read_batch)

    @guarded
    def last_log_id(self, ns: str) -> str:
        """The id of the log's newest entry (``"0-0"`` while it is empty)."""
        return stream_log.last_id(self.client, ns)

    @guarded
    def follow(self, ns: str, last_id: str, *, block_ms: int | None = 1000, count: int | None = None) -> list[LogEntry]:
        """Entries appended after ``last_id``, waiting up to ``block_ms`` for the first one.

        ``[]`` when nothing arrived in time. ``block_ms=None`` does not wait; ``0`` (wait
        forever) is refused. The client's ``socket_timeout`` must exceed ``block_ms``.
        """
        if block_ms is not None and block_ms < 1:
            raise ValueError(f"block_ms must be >= 1 or None, got {block_ms}")
        return stream_log.follow(self.client, ns, last_id, block_ms, count or self.config.read_batch)

    @guarded
    def log_identity(self, ns: str) -> str:
        """The namespace log's random identity, created on first use."""
        key = keys.log_identity(ns)
        self.client.set(key, uuid.uuid4().hex, nx=True)
        raw = self.client.get(key)
        if not isinstance(raw, bytes):
            raise StorageCorrupt(f"{key} is missing right after it was set")
        return raw.decode()

    @guarded
    def log_identities(self, names: list[str]) -> dict[str, str | None]:
        """Each namespace's log identity as it stands (``None`` where none was made yet), in one
        round trip; unlike :meth:`log_identity` it creates none."""
        found = self._get_each([keys.log_identity(ns) for ns in names])
        return {ns: raw.decode() if isinstance(raw, bytes) else None for ns, raw in zip(names, found, strict=True)}

    def _get_each(self, each_key: list[str]) -> list[object]:
        """GET of each key, in one round trip (a pipeline: the keys may lie in different cluster
        slots); none when there are none."""
        if not each_key:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in each_key:
            pipe.get(key)
        return list(pipe.execute())

    @guarded
    def log_size(self, ns: str) -> tuple[int, int]:
        """``(entries, tokens)`` in the namespace's log."""
        return stream_log.size(self.client, ns)

    # -- successor rows -----------------------------------------------------------------------

    @guarded
    def save_successors(self, ns: str, writer: str, tokens: np.ndarray, packed: list[bytes]) -> str | None:
        """Write successor rows and announce them to other replicas (see :mod:`.successors`)."""
        return successors.save(self.client, ns, writer, tokens, packed)

    @guarded
    def read_successors(self, ns: str) -> tuple[np.ndarray, list[bytes], str]:
        """Every stored successor row and the change stream's last id."""
        return successors.read_all(self.client, ns)

    @guarded
    def successor_changes(self, ns: str, after: str, writer: str) -> tuple[np.ndarray, list[bytes], str]:
        """Rows other writers changed since change ``after`` (see :func:`.successors.read_changes`)."""
        return successors.read_changes(self.client, ns, after, writer, self.config.read_batch)

    # -- priors -----------------------------------------------------------------------------

    @guarded
    def put_prior(self, ns: str, blob: bytes) -> int:
        """Store a prior blob as a new version, make it current, keep the old one for rollback.

        Versions increase per namespace. Returns the new version.
        """
        if not blob:
            raise ValueError("prior blob is empty")
        cfg = self.config
        version, meta = priors.stage(
            self.client, ns, blob, part_size=cfg.prior_part_bytes, ttl_s=cfg.prior_staging_ttl_s
        )
        priors.publish(self.client, ns, version, meta.parts)
        return version

    @guarded
    def get_prior(self, ns: str) -> tuple[int, bytearray] | None:
        """``(version, blob)`` of the current prior, verified against its checksum, or ``None``."""
        return priors.read_current(self.client, ns)

    @guarded
    def get_prior_range(self, ns: str, version: int, offset: int, length: int) -> tuple[priors.PriorMeta, bytes] | None:
        """A page of ``version``'s blob and its metadata (see :func:`.priors.read_range`)."""
        return priors.read_range(self.client, ns, version, offset, length)

    @guarded
    def prior_version(self, ns: str) -> int | None:
        """The current prior version (one GET: cheap enough to poll), or ``None``."""
        return priors.current_version(self.client, ns)

    @guarded
    def rollback_prior(self, ns: str) -> int | None:
        """Make the previous version current again (and the current one previous).

        Returns the version now current, or ``None`` when there is no previous version.
        """
        return priors.rollback(self.client, ns)

    # -- sessions ---------------------------------------------------------------------------

    def save_session(self, sid: str, session: StoredSession, ttl_s: float) -> bool:
        """Write a session's state and rejected table atomically, unless storage holds another
        tenant's session under ``sid``; whether it was written.

        Every key of the session gets a fresh ``ttl_s``-second expiry.
        """
        return self.save_sessions([(sid, session)], ttl_s)[0]

    @guarded
    def save_sessions(self, writes: list[sessions.SessionWrite], ttl_s: float) -> list[bool]:
        """:meth:`save_session` for many sessions in one round trip (per node on a cluster),
        each session's keys written atomically, but none over another tenant's session: per
        session, whether it was written."""
        return sessions.save_many(self.client, self._save_sessions, writes, ttl_s) if writes else []

    @guarded
    def append_sessions(self, appends: list[sessions.SessionAppend], ttl_s: float) -> list[bool]:
        """Per session, append its new tokens (and replace its rejected table when given) if
        storage holds exactly the context it last saved; which of them applied."""
        return sessions.append_many(self.client, self._append_sessions, appends, ttl_s) if appends else []

    @guarded
    def load_session(self, sid: str) -> StoredSession | None:
        """The session saved under ``sid``, or ``None`` if it expired or never existed.

        Loading does not refresh the expiry; call :meth:`touch_session` for that.
        """
        return sessions.load(self.client, sid)

    @guarded
    def touch_session(self, sid: str, ttl_s: float) -> bool:
        """Reset the session's expiry to ``ttl_s`` seconds; ``False`` if it does not exist."""
        return sessions.touch(self.client, sid, ttl_s)

    @guarded
    def delete_session(self, sid: str) -> bool:
        """Delete the session; ``False`` if there was nothing to delete."""
        return sessions.delete(self.client, sid)

    @guarded
    def delete_sessions(self, sids: list[str]) -> list[bool]:
        """:meth:`delete_session` for many sessions in one round trip (per session on a cluster)."""
        return sessions.delete_many(self.client, sids) if sids else []

    @guarded
    def session_ids(self, match: str = "*") -> list[str]:
        """Sorted ids of stored sessions whose id matches the glob ``match`` (via SCAN)."""
        return sessions.ids(self.client, match, self.config.read_batch)

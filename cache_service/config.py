"""Configuration of the service, built once at the entry point and passed whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from indexer.drafter import MAX_BUDGET, DrafterConfig, DraftParams


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Limits and defaults of one service process.

    >>> ServiceConfig(max_batch=0)
    Traceback (most recent call last):
    ...
    ValueError: max_batch must be in [1, 4096], got 0
    """

    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    default_params: DraftParams = field(default_factory=DraftParams)
    max_batch: int = 256  # sequences in one call
    max_prompt_tokens: int = 1 << 20
    max_new_tokens: int = 4096  # tokens one session may add in one call
    max_sessions: int = 100_000
    # Context tokens all sessions may hold in memory; past it the least recently used sessions
    # already written to storage leave memory (storage still continues them).
    max_session_tokens: int = 64 << 20
    session_ttl_s: float = 3600.0  # idle sessions expire (memory and storage)
    rebuild_interval_s: float = 30.0
    follow_interval_s: float = 0.2  # how often the lifetime log is polled for other replicas' commits
    flush_interval_s: float = 0.5  # write-behind period for session state (new tokens are appended)
    # A session's rejected table (a cache: losing its last changes costs draft quality only) is
    # rewritten at most this often (0: with every write-back), and always before the session may
    # leave memory and when the service stops.
    table_flush_interval_s: float = 5.0
    max_pending_writes: int = 100_000  # buffered write-backs while storage is down
    # The local journal of commits storage could not take; past it commits are refused.
    journal_capacity_bytes: int = 256 << 20
    # Drafting ahead (pre-speculation) is skipped while draft calls took more than this share of
    # the process's last second or so (cache_service.domain.busy): outcomes drafted ahead are
    # work for spare time, and for a chain they cost several times its own draft. 1: never skipped.
    ahead_busy_limit: float = 1.0

    def __post_init__(self) -> None:
        _range("max_batch", self.max_batch, 1, 4096)
        _range("max_prompt_tokens", self.max_prompt_tokens, 1, 1 << 26)
        _range("max_new_tokens", self.max_new_tokens, 1, 1 << 20)
        _range("max_sessions", self.max_sessions, 1, 1 << 30)
        _range("max_session_tokens", self.max_session_tokens, 1, 1 << 40)
        _range("max_pending_writes", self.max_pending_writes, 1, 1 << 30)
        _range("journal_capacity_bytes", self.journal_capacity_bytes, 1 << 10, 1 << 50)
        for name in ("session_ttl_s", "rebuild_interval_s", "follow_interval_s", "flush_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.ahead_busy_limit <= 1:
            raise ValueError(f"ahead_busy_limit must be in [0, 1], got {self.ahead_busy_limit}")
        if not self.table_flush_interval_s >= 0:
            raise ValueError(f"table_flush_interval_s must be >= 0, got {self.table_flush_interval_s}")
        if self.default_params.budget > MAX_BUDGET:
            raise ValueError(f"default budget must be <= {MAX_BUDGET}")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Where and how the gRPC server listens.

    >>> ServerConfig(switch_interval_s=0)
    Traceback (most recent call last):
    ...
    ValueError: switch_interval_s must be in [1e-05, 0.1], got 0
    """

    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port (tests)
    own_port: int | None = None  # also listen here, on a port this process alone serves
    # The port is shared with sibling worker processes (serve --processes), which the kernel
    # hands connections to in turn (SO_REUSEPORT). Otherwise a port another server holds is an
    # error at start, not a port two servers answer on at random.
    shared_port: bool = False
    max_message_bytes: int = 64 << 20
    grace_s: float = 5.0  # drain time on shutdown
    tokens_file: Path | None = None  # bearer tokens (cache_service.rpc.auth); None: no authentication
    tls_cert_file: Path | None = None  # PEM certificate chain; with the key, serve TLS
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None  # require client certificates signed by this CA (mTLS)
    # How long a thread running Python keeps the interpreter while another waits for it (the
    # process-wide switch interval; Python's default is 5 ms). A draft call that arrives while
    # a background job (following the log, writing sessions back) runs Python waits up to this.
    switch_interval_s: float = 0.0005

    def __post_init__(self) -> None:
        _range("port", self.port, 0, 65535)
        if not 1e-5 <= self.switch_interval_s <= 0.1:
            raise ValueError(f"switch_interval_s must be in [1e-05, 0.1], got {self.switch_interval_s}")
        if self.own_port is not None:
            _range("own_port", self.own_port, 1, 65535)
            if self.own_port == self.port:
                raise ValueError(f"own_port must differ from port, both are {self.port}")
        _range("max_message_bytes", self.max_message_bytes, 1024, 1 << 31)
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both a certificate and a key file")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("client certificates (mTLS) need the server's own TLS certificate and key")


@dataclass(frozen=True, kw_only=True)
class EmbeddedRedisConfig:
    """The local Redis-compatible server ``serve`` spawns when no URL is given."""

    data_dir: Path = Path("data/redis")
    port: int = 0  # 0: a free port
    appendonly: bool = True

    def __post_init__(self) -> None:
        _range("port", self.port, 0, 65535)


def _range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")

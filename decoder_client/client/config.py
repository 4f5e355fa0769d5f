"""The client's settings: where the service is, how long a step may wait for it, how to reach it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from indexer.drafter import MAX_LOOKAHEAD, DraftParams
from indexer.fingerprint import check_fingerprint
from indexer.successors import MAX_TOPK

# Reconnect quickly after an outage: the fallback covers the gap, not a long backoff.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# The most sessions any service takes in one call (``draftcache serve --max-batch`` goes up to it).
MOST_BATCH = 4096


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """One draft client's settings.

    >>> ClientConfig(target="127.0.0.1:50051", namespace="llama2", deadline_s=0.003).lookahead
    0
    """

    target: str
    namespace: str
    params: DraftParams = field(default_factory=DraftParams)
    deadline_s: float = 0.005  # per draft call; past it the fallback answers
    control_timeout_s: float = 1.0  # open / close calls
    retry_after_s: float = 0.5  # after a failure, skip the service this long
    # ... where a failure is an error, or this many draft calls in a row past their deadline:
    # one late answer (a pause in the service's process) costs its own step the fallback, not
    # the next ``retry_after_s`` of steps.
    late_before_skip: int = 2
    commit_backlog_tokens: int = 1_000_000  # ended requests kept to commit once the service answers again
    lookahead: int = 0  # pre-speculation: outcomes drafted ahead per step (0: off)
    # Chain mode: a step whose outcome the last chain foresaw (every token proposed accepted, the
    # bonus token its next one) goes on with the rest of that chain at once; the call that
    # delivers its tokens (and brings the chain for after them) runs while the target verifies.
    continue_chains: bool = False
    # ... for which chains are asked to run on past the cut the decoder cuts them at
    # (params.chain_min_prob, or cut_chains_at), to tokens this fraction as likely to be reached.
    chain_run_on: float = 1.0
    # ... and its rest stands in for a call only while it still holds this many tokens (what the
    # decoder takes of a chain; 0: any rest) or runs below the decoder's cut (it would not take
    # all of it): a short rest of a long sure chain would cost the step the chain a call brings.
    chain_take: int = 0
    topk: int = 0  # the target's top-k ids sent per verified position, when the decoder gives them (0: none)
    # The model's vocabulary: a tree from the service with an id outside it is not used (the
    # fallback drafts instead). It is stated on opens and log and prior reads: a service whose
    # namespace has another (another tokenizer) refuses them, and the client then drafts locally
    # and commits nothing there. 0: not stated, ids only checked to be >= 0.
    vocab_size: int = 0
    # The fingerprint of the model's tokenizer (indexer.fingerprint; "": not stated), stated
    # beside vocab_size: a namespace registered with another tokenizer of the same size refuses
    # the calls as it refuses another vocabulary.
    tokenizer: str = ""
    stream: bool = True  # calls on two bidirectional streams (False: one unary call each)
    # Sessions one call carries at most: the service's ``serve --max-batch`` (256 by default),
    # which refuses a larger call whole. A step's draft for a larger batch goes as several calls
    # sent at once, under the step's one deadline (and its background opens as several, one at a
    # time). A service that refuses a call as larger than its own limit, naming it, lowers this
    # for the client's later calls (see ClientCore.failed): set it only to split sooner.
    max_batch: int = 256
    token: str = ""  # bearer token, when the service authenticates callers
    tls_root_cert_file: str = ""  # PEM CA of the service's certificate: use TLS
    tls_cert_file: str = ""  # this client's certificate and key, for mutual TLS
    tls_key_file: str = ""

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.control_timeout_s <= 0 or self.retry_after_s < 0:
            raise ValueError("deadlines must be > 0 and retry_after_s >= 0")
        if self.late_before_skip < 1:
            raise ValueError(f"late_before_skip must be >= 1, got {self.late_before_skip}")
        if self.commit_backlog_tokens < 0:
            raise ValueError(f"commit_backlog_tokens must be >= 0, got {self.commit_backlog_tokens}")
        if not 0 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {self.lookahead}")
        if self.continue_chains and not self.params.chain:
            raise ValueError("continue_chains needs chain mode (params.chain > 0)")
        if not 0 <= self.chain_take <= self.params.chain:
            raise ValueError(f"chain_take must be in [0, params.chain={self.params.chain}], got {self.chain_take}")
        if not 0 < self.chain_run_on <= 1:
            raise ValueError(f"chain_run_on must be in (0, 1], got {self.chain_run_on}")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {self.vocab_size}")
        check_fingerprint(self.tokenizer)
        if not 1 <= self.max_batch <= MOST_BATCH:
            raise ValueError(f"max_batch must be in [1, {MOST_BATCH}], got {self.max_batch}")
        if not 0 <= self.topk <= MAX_TOPK:
            raise ValueError(f"topk must be in [0, {MAX_TOPK}], got {self.topk}")
        if not all(" " <= c <= "~" for c in self.token):  # not echoed: it is a secret
            raise ValueError(
                "token must be printable ASCII: gRPC sends no other header value, and every call "
                "would fail (a token read with its file's newline, say)"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("a client certificate needs its key (and the other way round)")
        if self.tls_cert_file and not self.tls_root_cert_file:
            raise ValueError("mutual TLS needs tls_root_cert_file too")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self) -> grpc.Channel:
        """A channel to the service: TLS where configured, reconnecting quickly
        (:data:`RECONNECT_OPTIONS`)."""
        creds = self.credentials()
        if creds is None:
            return grpc.insecure_channel(self.target, options=RECONNECT_OPTIONS)
        return grpc.secure_channel(self.target, creds, options=RECONNECT_OPTIONS)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials from the configured PEM files; None: plaintext. A file that cannot
        be read or holds no PEM block of its kind is a ``ValueError`` naming it: gRPC takes
        any bytes and fails every call's handshake."""
        if not self.tls_root_cert_file:
            return None
        return grpc.ssl_channel_credentials(
            _pem("tls_root_cert_file", self.tls_root_cert_file, b"CERTIFICATE-----"),
            _pem("tls_key_file", self.tls_key_file, b"PRIVATE KEY-----"),
            _pem("tls_cert_file", self.tls_cert_file, b"CERTIFICATE-----"),
        )


def _pem(setting: str, path: str, block: bytes) -> bytes | None:
    """The PEM file ``path`` (None where it is not set), checked to hold a ``block`` (the end of
    its ``-----BEGIN ...`` line)."""
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data or block not in data:
        raise ValueError(f"{setting}: {path} holds no PEM {block.rstrip(b'-').decode().lower()}")
    return data

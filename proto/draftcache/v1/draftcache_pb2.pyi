from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftParams(_message.Message):
    __slots__ = ("budget", "max_depth", "min_score", "depth_reserve", "chain", "chain_min_prob")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_RESERVE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    CHAIN_MIN_PROB_FIELD_NUMBER: _ClassVar[int]
    budget: int
    max_depth: int
    min_score: float
    depth_reserve: int
    chain: int
    chain_min_prob: float
    def __init__(self, budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., min_score: _Optional[float] = ..., depth_reserve: _Optional[int] = ..., chain: _Optional[int] = ..., chain_min_prob: _Optional[float] = ...) -> None: ...

class Tree(_message.Message):
    __slots__ = ("tokens", "parents", "sources", "scores")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    sources: bytes
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., sources: _Optional[bytes] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("namespace", "prompt", "params", "session_id", "vocab_size", "tokenizer")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    params: DraftParams
    session_id: str
    vocab_size: int
    tokenizer: str
    def __init__(self, namespace: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[DraftParams, _Mapping]] = ..., session_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class OpenSessionsRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[OpenSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[OpenSession, _Mapping]]] = ...) -> None: ...

class OpenSessionsResponse(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftItem(_message.Message):
    __slots__ = ("session_id", "new_tokens", "lookahead", "topk", "topk_k", "topk_after")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_K_FIELD_NUMBER: _ClassVar[int]
    TOPK_AFTER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    lookahead: int
    topk: _containers.RepeatedScalarFieldContainer[int]
    topk_k: int
    topk_after: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., new_tokens: _Optional[_Iterable[int]] = ..., lookahead: _Optional[int] = ..., topk: _Optional[_Iterable[int]] = ..., topk_k: _Optional[int] = ..., topk_after: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftColumns(_message.Message):
    __slots__ = ("session_ids", "new_token_counts", "new_tokens", "lookahead", "topk", "topk_k", "topk_after", "topk_counts")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_K_FIELD_NUMBER: _ClassVar[int]
    TOPK_AFTER_FIELD_NUMBER: _ClassVar[int]
    TOPK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    new_token_counts: _containers.RepeatedScalarFieldContainer[int]
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    lookahead: _containers.RepeatedScalarFieldContainer[int]
    topk: _containers.RepeatedScalarFieldContainer[int]
    topk_k: int
    topk_after: _containers.RepeatedScalarFieldContainer[int]
    topk_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., new_token_counts: _Optional[_Iterable[int]] = ..., new_tokens: _Optional[_Iterable[int]] = ..., lookahead: _Optional[_Iterable[int]] = ..., topk: _Optional[_Iterable[int]] = ..., topk_k: _Optional[int] = ..., topk_after: _Optional[_Iterable[int]] = ..., topk_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("items", "columns")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    columns: DraftColumns
    def __init__(self, items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ..., columns: _Optional[_Union[DraftColumns, _Mapping]] = ...) -> None: ...

class Prefetch(_message.Message):
    __slots__ = ("accepted", "tree")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    tree: Tree
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[Tree, _Mapping]] = ...) -> None: ...

class Prefetched(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Prefetch]
    def __init__(self, items: _Optional[_Iterable[_Union[Prefetch, _Mapping]]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("trees", "prefetched")
    TREES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[Tree]
    prefetched: _containers.RepeatedCompositeFieldContainer[Prefetched]
    def __init__(self, trees: _Optional[_Iterable[_Union[Tree, _Mapping]]] = ..., prefetched: _Optional[_Iterable[_Union[Prefetched, _Mapping]]] = ...) -> None: ...

class RejectedBranch(_message.Message):
    __slots__ = ("offset", "tokens")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class FeedbackItem(_message.Message):
    __slots__ = ("session_id", "accepted", "rejected")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accepted: _containers.RepeatedScalarFieldContainer[int]
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedBranch]
    def __init__(self, session_id: _Optional[str] = ..., accepted: _Optional[_Iterable[int]] = ..., rejected: _Optional[_Iterable[_Union[RejectedBranch, _Mapping]]] = ...) -> None: ...

class FeedbackRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[FeedbackItem]
    def __init__(self, items: _Optional[_Iterable[_Union[FeedbackItem, _Mapping]]] = ...) -> None: ...

class FeedbackResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ("session_id", "commit", "commit_from", "missing_ok", "new_tokens", "commit_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FROM_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit: bool
    commit_from: int
    missing_ok: bool
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    commit_key: str
    def __init__(self, session_id: _Optional[str] = ..., commit: _Optional[bool] = ..., commit_from: _Optional[int] = ..., missing_ok: _Optional[bool] = ..., new_tokens: _Optional[_Iterable[int]] = ..., commit_key: _Optional[str] = ...) -> None: ...

class CloseSessionsRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[CloseSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[CloseSession, _Mapping]]] = ...) -> None: ...

class CloseSessionsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id", "open", "draft", "feedback", "close")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    open: OpenSessionsRequest
    draft: DraftRequest
    feedback: FeedbackRequest
    close: CloseSessionsRequest
    def __init__(self, request_id: _Optional[int] = ..., open: _Optional[_Union[OpenSessionsRequest, _Mapping]] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., feedback: _Optional[_Union[FeedbackRequest, _Mapping]] = ..., close: _Optional[_Union[CloseSessionsRequest, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("request_id", "open", "draft", "feedback", "close", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    open: OpenSessionsResponse
    draft: DraftResponse
    feedback: FeedbackResponse
    close: CloseSessionsResponse
    error: StreamError
    def __init__(self, request_id: _Optional[int] = ..., open: _Optional[_Union[OpenSessionsResponse, _Mapping]] = ..., draft: _Optional[_Union[DraftResponse, _Mapping]] = ..., feedback: _Optional[_Union[FeedbackResponse, _Mapping]] = ..., close: _Optional[_Union[CloseSessionsResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class ReadLogRequest(_message.Message):
    __slots__ = ("namespace", "after", "max_tokens", "vocab_size", "tokenizer")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    after: str
    max_tokens: int
    vocab_size: int
    tokenizer: str
    def __init__(self, namespace: _Optional[str] = ..., after: _Optional[str] = ..., max_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class LogEntry(_message.Message):
    __slots__ = ("id", "tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadLogResponse(_message.Message):
    __slots__ = ("entries", "last")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LogEntry]
    last: str
    def __init__(self, entries: _Optional[_Iterable[_Union[LogEntry, _Mapping]]] = ..., last: _Optional[str] = ...) -> None: ...

class ReadPriorRequest(_message.Message):
    __slots__ = ("namespace", "version", "offset", "max_bytes", "vocab_size", "tokenizer")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    version: int
    offset: int
    max_bytes: int
    vocab_size: int
    tokenizer: str
    def __init__(self, namespace: _Optional[str] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class ReadPriorResponse(_message.Message):
    __slots__ = ("version", "size", "digest", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    size: int
    digest: str
    data: bytes
    def __init__(self, version: _Optional[int] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "buffered_tokens", "requests", "index_tokens", "last_rebuild_seconds", "prior_version", "sessions", "tokenizer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_REBUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    buffered_tokens: int
    requests: int
    index_tokens: int
    last_rebuild_seconds: float
    prior_version: int
    sessions: int
    tokenizer: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., buffered_tokens: _Optional[int] = ..., requests: _Optional[int] = ..., index_tokens: _Optional[int] = ..., last_rebuild_seconds: _Optional[float] = ..., prior_version: _Optional[int] = ..., sessions: _Optional[int] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class CreateNamespaceRequest(_message.Message):
    __slots__ = ("name", "vocab_size", "tokenizer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    tokenizer: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ...) -> None: ...

class CreateNamespaceResponse(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceInfo
    def __init__(self, namespace: _Optional[_Union[NamespaceInfo, _Mapping]] = ...) -> None: ...

class NamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("namespaces", "sessions", "drafts", "pending_writes", "schema", "storage")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    sessions: int
    drafts: int
    pending_writes: int
    schema: str
    storage: StorageHealth
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ..., sessions: _Optional[int] = ..., drafts: _Optional[int] = ..., pending_writes: _Optional[int] = ..., schema: _Optional[str] = ..., storage: _Optional[_Union[StorageHealth, _Mapping]] = ...) -> None: ...

class StorageHealth(_message.Message):
    __slots__ = ("available", "last_error", "unavailable_seconds", "journaled_commits", "journal_bytes", "journal_capacity_bytes", "disk_full", "embedded_restarts", "repeated_commits")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOURNALED_COMMITS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FULL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDED_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    REPEATED_COMMITS_FIELD_NUMBER: _ClassVar[int]
    available: bool
    last_error: str
    unavailable_seconds: float
    journaled_commits: int
    journal_bytes: int
    journal_capacity_bytes: int
    disk_full: bool
    embedded_restarts: int
    repeated_commits: int
    def __init__(self, available: _Optional[bool] = ..., last_error: _Optional[str] = ..., unavailable_seconds: _Optional[float] = ..., journaled_commits: _Optional[int] = ..., journal_bytes: _Optional[int] = ..., journal_capacity_bytes: _Optional[int] = ..., disk_full: _Optional[bool] = ..., embedded_restarts: _Optional[int] = ..., repeated_commits: _Optional[int] = ...) -> None: ...

class DeleteNamespaceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteNamespaceResponse(_message.Message):
    __slots__ = ("sessions_closed",)
    SESSIONS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    sessions_closed: int
    def __init__(self, sessions_closed: _Optional[int] = ...) -> None: ...

class RebuildRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class RebuildResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

"""Every Redis key draftcache uses, in one place.

Layout (``v1`` is the key-layout generation; the *schema* version that migrations track is the
separate integer under :data:`SCHEMA_VERSION`; that key and the migration lock belong to
:mod:`migrations.keys` and are listed here so this table shows every key)::

    draftcache:schema_version                          string  integer, see migrations/
    {draftcache:schema_version}:migration_lock         string  SET NX PX token while migrating
    draftcache:v1:namespaces                           hash    namespace name -> vocab_size
    draftcache:v1:ns:{<ns>}:log                        stream  lifetime log: per request n, tokens, k (its commit key)
    draftcache:v1:ns:{<ns>}:log:tokens                 string  tokens currently in the log
    draftcache:v1:ns:{<ns>}:log:identity               string  random id of this log (SET NX)
    draftcache:v1:ns:{<ns>}:log:writers                hash    writer id -> highest commit seq appended (TTL)
    draftcache:v1:ns:{<ns>}:log:keys                   zset    commit key -> ms it was appended (trimmed, TTL)
    draftcache:v1:ns:{<ns>}:tokenizer                  string  fingerprint of its tokenizer (SET NX)
    draftcache:v1:ns:{<ns>}:succ                       hash    token -> successor row (indexer.successors)
    draftcache:v1:ns:{<ns>}:succ:changes               stream  tokens each write changed (capped)
    draftcache:v1:ns:{<ns>}:prior:seq                  string  last prior version handed out
    draftcache:v1:ns:{<ns>}:prior:current              string  version replicas serve
    draftcache:v1:ns:{<ns>}:prior:previous             string  version kept for rollback
    draftcache:v1:ns:{<ns>}:prior:<version>:meta       hash    parts, size, part_size, blake2b
    draftcache:v1:ns:{<ns>}:prior:<version>:<part>     string  one chunk of the blob
    draftcache:v1:session:{<sid>}:state                hash    namespace, context, prompt_len, params, tenant
    draftcache:v1:session:{<sid>}:rej                  string  rejected table (codec.encode_table)

The ``{...}`` hash tags put all of one namespace's keys, and all of one session's keys, in one
Redis Cluster slot, so the multi-key transactions and scripts over them are legal on a cluster.
The migration lock is tagged with the whole schema-version key name (a key without a tag hashes
whole), so the script that records a step under the lock touches one slot too. The namespace
registry is only ever used on its own. (Up to schema v2 a session also had an always-empty
``:dyn`` key; migration v3 deletes those.)
A tenant-scoped namespace is simply named ``<tenant>/<namespace>``.
"""

from __future__ import annotations

import re

from migrations.keys import MIGRATION_LOCK, SCHEMA_VERSION

__all__ = ["MIGRATION_LOCK", "SCHEMA_VERSION"]  # with every name below: the one key table

PREFIX = "draftcache"
LAYOUT = "v1"
_BASE = f"{PREFIX}:{LAYOUT}"

NAMESPACES = f"{_BASE}:namespaces"

MAX_NAME_LEN = 128
# No braces (they would break the hash tag), no glob characters (they would break SCAN
# patterns), no whitespace or control characters.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+=-]*")
_MATCH = re.compile(r"[A-Za-z0-9._:/@+=*?-]+")


def check_name(name: str, *, what: str = "name") -> str:
    """Return ``name`` if it may appear inside a key, else raise ``ValueError``.

    Names are 1-128 characters from ``A-Z a-z 0-9 . _ : / @ + = -``, starting alphanumeric.

    >>> check_name("acme/llama2")
    'acme/llama2'
    >>> check_name("a{b}")
    Traceback (most recent call last):
    ...
    ValueError: name must be 1-128 characters of [A-Za-z0-9._:/@+=-] starting alphanumeric, got 'a{b}'
    """
    if not isinstance(name, str) or len(name) > MAX_NAME_LEN or not _NAME.fullmatch(name):
        raise ValueError(
            f"{what} must be 1-{MAX_NAME_LEN} characters of [A-Za-z0-9._:/@+=-] starting alphanumeric, got {name!r}"
        )
    return name


def _ns(ns: str) -> str:
    return f"{_BASE}:ns:{{{check_name(ns, what='namespace')}}}"


def _session(sid: str) -> str:
    return f"{_BASE}:session:{{{check_name(sid, what='session id')}}}"


def successors(ns: str) -> str:
    """The namespace's successor rows, by token.

    >>> successors("llama2")
    'draftcache:v1:ns:{llama2}:succ'
    """
    return f"{_ns(ns)}:succ"


def successor_changes(ns: str) -> str:
    """The stream of the tokens each write of successor rows changed."""
    return f"{successors(ns)}:changes"


def log(ns: str) -> str:
    """The namespace's lifetime log stream.

    >>> log("llama2")
    'draftcache:v1:ns:{llama2}:log'
    """
    return f"{_ns(ns)}:log"


def log_tokens(ns: str) -> str:
    """Running total of the tokens held by :func:`log` (kept exact by the append script)."""
    return f"{_ns(ns)}:log:tokens"


def log_identity(ns: str) -> str:
    """A random id set once per log: files indexing a log's positions name the log they index,
    so positions of a different (say flushed and refilled) log are never taken for them."""
    return f"{_ns(ns)}:log:identity"


def log_writers(ns: str) -> str:
    """Per commit writer (one service process), the highest commit number it appended to
    :func:`log`: a journal replayed after an uncertain append skips what the log holds.

    >>> log_writers("llama2")
    'draftcache:v1:ns:{llama2}:log:writers'
    """
    return f"{_ns(ns)}:log:writers"


def log_commit_keys(ns: str) -> str:
    """The commit keys clients named the commits appended to :func:`log` with lately, each
    scored with when (ms): a client's retry of a commit that landed is not appended again.

    >>> log_commit_keys("llama2")
    'draftcache:v1:ns:{llama2}:log:keys'
    """
    return f"{_ns(ns)}:log:keys"


def tokenizer(ns: str) -> str:
    """The fingerprint of the tokenizer whose ids the namespace holds (indexer.fingerprint),
    set once by the first caller that states one; absent: none stated yet.

    >>> tokenizer("llama2")
    'draftcache:v1:ns:{llama2}:tokenizer'
    """
    return f"{_ns(ns)}:tokenizer"


LOG_PATTERN = f"{_BASE}:ns:{{*}}:log"  # SCAN pattern matching every namespace's log stream


def namespace_pattern(ns: str) -> str:
    """SCAN pattern matching every key of one namespace (all in its hash slot); names hold no
    glob characters, so the name matches only itself.

    >>> namespace_pattern("acme/llama2")
    'draftcache:v1:ns:{acme/llama2}:*'
    """
    return f"{_ns(ns)}:*"


def prior_seq(ns: str) -> str:
    return f"{_ns(ns)}:prior:seq"


def prior_current(ns: str) -> str:
    return f"{_ns(ns)}:prior:current"


def prior_previous(ns: str) -> str:
    return f"{_ns(ns)}:prior:previous"


def prior_meta(ns: str, version: int) -> str:
    """
    >>> prior_meta("llama2", 3)
    'draftcache:v1:ns:{llama2}:prior:3:meta'
    """
    return f"{_ns(ns)}:prior:{int(version)}:meta"


def prior_part(ns: str, version: int, part: int) -> str:
    return f"{_ns(ns)}:prior:{int(version)}:{int(part)}"


def session_state(sid: str) -> str:
    """
    >>> session_state("3f2a")
    'draftcache:v1:session:{3f2a}:state'
    """
    return f"{_session(sid)}:state"


def session_rej(sid: str) -> str:
    return f"{_session(sid)}:rej"


def session_keys(sid: str) -> tuple[str, str]:
    """All keys of one session: state, rejected table."""
    return session_state(sid), session_rej(sid)


def session_state_pattern(match: str = "*") -> str:
    """SCAN pattern over session state keys whose id matches the glob ``match``.

    >>> session_state_pattern("ab*")
    'draftcache:v1:session:{ab*}:state'
    """
    if not _MATCH.fullmatch(match) or len(match) > MAX_NAME_LEN:
        raise ValueError(f"match must be a glob of [A-Za-z0-9._:/@+=-*?], got {match!r}")
    return f"{_BASE}:session:{{{match}}}:state"


def tag_of(key: str | bytes) -> str:
    """The hash-tagged name inside a key (a namespace or a session id).

    >>> tag_of(b"draftcache:v1:session:{3f2a}:state")
    '3f2a'
    """
    text = key.decode() if isinstance(key, bytes) else key
    start, end = text.find("{"), text.find("}")
    if start < 0 or end <= start + 1:
        raise ValueError(f"key has no hash tag: {text!r}")
    return text[start + 1 : end]

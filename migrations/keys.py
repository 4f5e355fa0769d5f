"""The Redis keys migrations own or touch, frozen as each migration knew them.

The schema version and the migration lock belong to migrations (``cache_service.storage.keys``
imports them, so its table still lists every key). The other names are written out as the
layout stood when the migration that touches them was written: a migration must keep its
meaning when the service's current layout moves on.
"""

from __future__ import annotations

SCHEMA_VERSION = "draftcache:schema_version"
# Same slot as SCHEMA_VERSION (a key without a hash tag hashes whole), so the script recording a
# step under the lock touches one slot. (Builds before Redis Cluster support locked
# draftcache:migration_lock: do not run `draftcache migrate` from an old and a new build at once.)
MIGRATION_LOCK = "{draftcache:schema_version}:migration_lock"

# Layout v1, as v002 found it: every namespace's lifetime log stream and its token counter.
V1_LOG_PATTERN = "draftcache:v1:ns:{*}:log"


def v1_log(ns: str) -> str:
    """
    >>> v1_log("llama2")
    'draftcache:v1:ns:{llama2}:log'
    """
    return f"draftcache:v1:ns:{{{ns}}}:log"


def v1_log_tokens(ns: str) -> str:
    return f"{v1_log(ns)}:tokens"


# Layout v1, as v003 found it: a session's dynamic-table key, written empty and never read.
V1_SESSION_DYN_PATTERN = "draftcache:v1:session:{*}:dyn"


def tag_of(key: str | bytes) -> str:
    """The hash-tagged name inside a key (a namespace or a session id).

    >>> tag_of(b"draftcache:v1:ns:{llama2}:log")
    'llama2'
    """
    text = key.decode() if isinstance(key, bytes) else key
    return text[text.index("{") + 1 : text.index("}")]

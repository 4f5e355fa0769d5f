"""A session as storage keeps it, and its one byte layout.

A stored session is what another replica (or this one after a restart) needs to continue it:
its namespace, its snapshot (context tokens, prompt length, rejected table), its draft
parameters and the tenant it belongs to. It is written as two keys of one hash slot (see
:mod:`cache_service.storage.keys`): a state hash (:func:`encode_state`) and the rejected table
(:func:`codec.encode_table`). The dynamic tier needs no key of its own: it is read off the
context tokens.

The tenant is a field of the state hash (no new key, so no key-schema migration). Records
written before it existed have no such field and decode as tenant ``""``: the tenant of a
service without authentication. With authentication on, every tenant has a non-empty name, so
such a session belongs to nobody who can call: it is unknown to every caller (its client opens
a new one) and expires with its TTL; nobody can take it over.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cache_service.storage import codec
from cache_service.storage.errors import StorageCorrupt
from indexer.drafter import DraftParams
from indexer.session import SessionSnapshot

STATE_FORMAT = b"1"


@dataclass(frozen=True, eq=False)
class StoredSession:
    """A session as storage keeps it, for another replica (or a restart) to continue.

    >>> snap = SessionSnapshot(context=np.array([5, 6, 7], np.int32), prompt_len=2)
    >>> s = decode(*encode(StoredSession("llama2", snap, DraftParams(budget=8), tenant="acme")))
    >>> s.namespace, s.snapshot.context.tolist(), s.snapshot.prompt_len, s.params.budget, s.tenant
    ('llama2', [5, 6, 7], 2, 8, 'acme')
    """

    namespace: str
    snapshot: SessionSnapshot
    params: DraftParams
    tenant: str = ""  # who opened it ("" when callers are not authenticated)

    @property
    def context(self) -> np.ndarray:
        return self.snapshot.context

    @property
    def prompt_len(self) -> int:
        return self.snapshot.prompt_len


def encode(session: StoredSession) -> tuple[dict[bytes, bytes], bytes]:
    """The state hash's fields and the rejected table's blob; ``ValueError`` for a context
    that is not a 1-D int32 array."""
    return encode_state(session), codec.encode_table(session.snapshot.rejected)


def encode_state(session: StoredSession) -> dict[bytes, bytes]:
    """Hash fields of a session's ``state`` key (every field rewritten on each whole save)."""
    snap = session.snapshot
    params = json.dumps(dict(vars(session.params)), sort_keys=True, allow_nan=False)  # flat: asdict copies deep
    return {
        b"fmt": STATE_FORMAT,
        b"namespace": session.namespace.encode(),
        b"context": codec.tokens_to_bytes(snap.context),
        b"prompt_len": str(snap.prompt_len).encode(),
        b"params": params.encode(),
        b"tenant": session.tenant.encode(),
    }


def decode(fields: Mapping[bytes, bytes], rejected: bytes | None) -> StoredSession:
    """Inverse of :func:`encode`; a missing rejected table (``None``) loads as empty, as a cache
    may lose a key. :class:`StorageCorrupt` for anything :func:`encode` did not write."""
    if fields.get(b"fmt") != STATE_FORMAT:
        raise StorageCorrupt(f"session state has format {fields.get(b'fmt')!r}, expected {STATE_FORMAT!r}")
    try:
        params = json.loads(fields[b"params"])
        if not isinstance(params, dict):
            raise ValueError("params is not a JSON object")
        context = np.array(codec.tokens_from_bytes(fields[b"context"], what="session context"))  # writable
        prompt_len = int(fields[b"prompt_len"])
        if not 0 <= prompt_len <= context.size:
            raise ValueError(f"prompt_len {prompt_len} outside a context of {context.size} tokens")
        table = codec.decode_columns(rejected) if rejected is not None else codec.empty_columns()
        snapshot = SessionSnapshot(context=context, prompt_len=prompt_len, rejected=table)
        tenant = fields.get(b"tenant", b"").decode()  # absent in records older than the field
        return StoredSession(fields[b"namespace"].decode(), snapshot, DraftParams(**params), tenant)
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise StorageCorrupt(f"session state does not decode: {exc!r}") from exc

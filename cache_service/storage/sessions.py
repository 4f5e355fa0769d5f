"""A session's durable copy: its state hash and rejected table, both under one TTL."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from redis.cluster import RedisCluster
from redis.commands.core import Script

from cache_service.storage import codec, keys, stored_session
from cache_service.storage.clients import StorageClient, transaction
from cache_service.storage.stored_session import StoredSession

# KEYS: state, rej (one slot); ARGV[1] expiry ms, [2] rej blob, [3] the session's tenant, then
# the state's field/value pairs: the session's keys replaced whole, atomically, so many
# sessions can go in one pipelined round trip; but never over another tenant's session (0,
# nothing written): an id a replica could not check when it opened the session (storage was
# down) may turn out to be taken.
SAVE_LUA = """
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if tenant and tenant ~= ARGV[3] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
return 1
"""

# KEYS: state, rej (one slot); ARGV[1] expiry ms, [2] bytes of context storage should hold,
# [3] tokens to append, [4] "1" when [5] (a rejected-table blob) replaces the stored table.
# Appends only onto exactly the context the writer last saved; 0 (nothing written) when the
# session is gone or its context differs, and the writer saves the whole session instead.
APPEND_LUA = """
local ctx = redis.call('HGET', KEYS[1], 'context')
if not ctx or string.len(ctx) ~= tonumber(ARGV[2]) then
  return 0
end
if string.len(ARGV[3]) > 0 then
  redis.call('HSET', KEYS[1], 'context', ctx .. ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if ARGV[4] == '1' then
  redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[1])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
end
return 1
"""

SessionWrite = tuple[str, StoredSession]
# (session id, context tokens storage holds, tokens to append, new rejected table or None)
SessionAppend = tuple[str, int, np.ndarray, codec.Table | None]


def ttl_ms(ttl_s: float) -> int:
    """Expiry in whole milliseconds (at least 1) for ``ttl_s`` seconds.

    >>> ttl_ms(1.5)
    1500
    """
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < 1e9:
        raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    return max(1, round(ttl_s * 1000))


def save_many(client: StorageClient, script: Script, writes: Sequence[SessionWrite], ttl_s: float) -> list[bool]:
    """Sessions written whole in one pipelined round trip (on a cluster, where sessions
    live on different nodes, one call per session), each session's writes atomic (``script`` is
    :data:`SAVE_LUA` registered on ``client``), except where storage holds another tenant's
    session under the id. Per session, whether it was written."""
    ms = ttl_ms(ttl_s)

    def args(session: StoredSession) -> list[str | bytes | int]:
        fields, rej_blob = stored_session.encode(session)
        return [ms, rej_blob, session.tenant, *(x for kv in fields.items() for x in kv)]

    if isinstance(client, RedisCluster):
        return [bool(script(keys=list(keys.session_keys(sid)), args=args(session))) for sid, session in writes]
    pipe = client.pipeline(transaction=False)
    for sid, session in writes:
        script(keys=list(keys.session_keys(sid)), args=args(session), client=pipe)
    return [bool(r) for r in pipe.execute()]


def append_many(client: StorageClient, script: Script, appends: Sequence[SessionAppend], ttl_s: float) -> list[bool]:
    """Add what each session gained since its last save: tokens onto its stored context (only
    where storage holds exactly ``held`` tokens of it) and, when given, its new rejected table;
    every key's expiry is refreshed. One pipelined round trip (on a cluster, one call per
    session). Per session, whether it applied; one that did not needs a whole save (:func:`save_many`)."""
    ms = ttl_ms(ttl_s)

    def args(held: int, tokens: np.ndarray, rej: codec.Table | None) -> list[str | bytes | int]:
        table = codec.encode_table(rej) if rej is not None else b""
        return [ms, 4 * held, codec.tokens_to_bytes(tokens), "1" if rej is not None else "0", table]

    if isinstance(client, RedisCluster):
        return [
            bool(script(keys=list(keys.session_keys(sid)), args=args(held, tokens, rej)))
            for sid, held, tokens, rej in appends
        ]
    pipe = client.pipeline(transaction=False)
    for sid, held, tokens, rej in appends:
        script(keys=list(keys.session_keys(sid)), args=args(held, tokens, rej), client=pipe)
    return [bool(r) for r in pipe.execute()]


def load(client: StorageClient, sid: str) -> StoredSession | None:
    state_key, rej_key = keys.session_keys(sid)
    with transaction(client, state_key) as pipe:
        pipe.hgetall(state_key)
        pipe.get(rej_key)
        fields, rej_blob = pipe.execute()
    if not fields:
        return None
    where = f"session {sid!r}"
    # The table shares the state's expiry; one that is missing anyway loads as empty.
    rej = codec.as_bytes(rej_blob, what=where) if rej_blob is not None else None
    return stored_session.decode(codec.as_fields(fields, what=where), rej)


def touch(client: StorageClient, sid: str, ttl_s: float) -> bool:
    ms = ttl_ms(ttl_s)
    with transaction(client, keys.session_state(sid)) as pipe:
        for key in keys.session_keys(sid):
            pipe.pexpire(key, ms)
        found = pipe.execute()
    return bool(found[0])


def delete(client: StorageClient, sid: str) -> bool:
    return bool(client.delete(*keys.session_keys(sid)))


def delete_many(client: StorageClient, sids: Sequence[str]) -> list[bool]:
    """:func:`delete` for many sessions in one pipelined round trip (on a cluster, one call per
    session: its keys share a slot). Per session, whether there was anything to delete."""
    if isinstance(client, RedisCluster):
        return [delete(client, sid) for sid in sids]
    pipe = client.pipeline(transaction=False)
    for sid in sids:
        pipe.delete(*keys.session_keys(sid))
    return [bool(n) for n in pipe.execute()]


def ids(client: StorageClient, match: str, batch: int) -> list[str]:
    pattern = keys.session_state_pattern(match)
    return sorted({keys.tag_of(key) for key in client.scan_iter(match=pattern, count=batch)})

"""A namespace's lifetime log: a Redis Stream of finished requests, capped by token count.

Entry fields: ``n`` (token count, decimal) and ``tokens`` (``n`` little-endian int32 ids).
A counter key beside the stream holds the exact number of tokens it contains; one Lua script
appends a batch, trims the oldest entries until the total fits the cap, and updates the
counter, so concurrent writers can never make the two disagree.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
from redis.commands.core import Script

from cache_service.storage import codec, keys
from cache_service.storage.clients import StorageClient, on_one_connection, transaction
from cache_service.storage.errors import StorageCorrupt

# Shared by both append scripts: the running token total, read before the appends...
_TOTAL_LUA = """
local function count_of(fields)
  for j = 1, #fields, 2 do
    if fields[j] == 'n' then return tonumber(fields[j + 1]) end
  end
  return nil
end
local raw = redis.call('GET', KEYS[2])
local total = nil
if raw then
  total = tonumber(raw)
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  total = 0
end
if not total then
  return redis.error_reply('CORRUPT token counter of ' .. KEYS[1] .. ' is missing or bad (run draftcache migrate)')
end
local cap = tonumber(ARGV[1])
local ids = {}
"""
# ... and the trim to the cap, after them.
_TRIM_LUA = """
local last = nil
while total > cap do
  local batch = redis.call('XRANGE', KEYS[1], last and ('(' .. last) or '-', '+', 'COUNT', 256)
  if #batch == 0 then break end
  for _, entry in ipairs(batch) do
    if total <= cap then break end
    local n = count_of(entry[2])
    if not n then return redis.error_reply('CORRUPT log entry ' .. entry[1] .. ' has no token count') end
    total = total - n
    last = entry[1]
  end
end
if last then
  -- MINID evicts ids strictly below the threshold: the successor of the last dropped id.
  local ms, seq = string.match(last, '^(%d+)-(%d+)$')
  redis.call('XTRIM', KEYS[1], 'MINID', ms .. '-' .. string.format('%d', tonumber(seq) + 1))
end
redis.call('SET', KEYS[2], string.format('%d', total))
return ids
"""

# KEYS[1] stream, KEYS[2] token counter; ARGV[1] cap, then (tokens, n) per request.
APPEND_LUA = (
    _TOTAL_LUA
    + """
for i = 2, #ARGV, 2 do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'n', ARGV[i + 1], 'tokens', ARGV[i])
  total = total + tonumber(ARGV[i + 1])
end
"""
    + _TRIM_LUA
)

# Commits with ids, each appended at most once. KEYS[1] stream, KEYS[2] token counter, KEYS[3]
# writers (writer -> highest seq appended), KEYS[4] the log's identity, KEYS[5] commit keys (key ->
# ms appended); ARGV[1] cap, ARGV[2] the writers hash's TTL in seconds, ARGV[3] the identity of
# the log the commits were made for ('' when not known), ARGV[4] how long a commit key is kept
# (ms), ARGV[5] how many are kept at most, then (tokens, n, writer, seq, key) per commit, each
# writer's in increasing seq. A commit whose seq is not above its writer's recorded one is in the
# log already (this service's retry), and so is one whose key the log recorded (a client's retry
# of a commit that landed, under another session): its id is ''. A keyed commit's entry holds its
# key ('k'): a replica that has the request in memory already (journaled while storage was down)
# knows another's append of it when following the log. Commits made for another log
# (the namespace deleted, perhaps created again) are refused whole: the answer is {'replaced'}.
# The clock is the server's (TIME, before any write), so every replica's commits age alike. The
# first write is the XADD or HSET, which Redis refuses when out of memory (a write that frees
# memory first would let the rest through), so such a refusal writes nothing.
APPEND_ONCE_LUA = (
    """
if ARGV[3] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[3] then
  return {'replaced'}
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local since = now - tonumber(ARGV[4])
"""
    + _TOTAL_LUA
    + """
local keyed = false
for i = 6, #ARGV, 5 do
  local seen = tonumber(redis.call('HGET', KEYS[3], ARGV[i + 2]) or '-1')
  local key = ARGV[i + 4]
  if tonumber(ARGV[i + 3]) <= seen then
    ids[#ids + 1] = ''
  elseif key ~= '' and tonumber(redis.call('ZSCORE', KEYS[5], key) or '-1') >= since then
    redis.call('HSET', KEYS[3], ARGV[i + 2], ARGV[i + 3])
    ids[#ids + 1] = ''
  else
    if key ~= '' then
      ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'n', ARGV[i + 1], 'tokens', ARGV[i], 'k', key)
    else
      ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'n', ARGV[i + 1], 'tokens', ARGV[i])
    end
    redis.call('HSET', KEYS[3], ARGV[i + 2], ARGV[i + 3])
    total = total + tonumber(ARGV[i + 1])
    if key ~= '' then
      redis.call('ZADD', KEYS[5], now, key)
      keyed = true
    end
  end
end
redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. string.format('%d', since))
if keyed then
  local over = redis.call('ZCARD', KEYS[5]) - tonumber(ARGV[5])
  if over > 0 then redis.call('ZREMRANGEBYRANK', KEYS[5], 0, over - 1) end
  redis.call('PEXPIRE', KEYS[5], ARGV[4])
end
"""
    + _TRIM_LUA
)


MAX_KEY_LEN = 64  # characters of a commit key (the service takes 16-64 of [A-Za-z0-9._:-])


class Commit(NamedTuple):
    """One commit to append once: its id ``(writer, seq)`` (a writer id, its commit number),
    the request's tokens and the key its client named it with ("": none)."""

    writer: bytes
    seq: int
    tokens: np.ndarray
    key: str = ""


class NotReplicated(Exception):
    """Commits the master appended, which fewer of its replicas than asked confirmed in time:
    a failover now could lose them. Not a storage error: they are in the log (their ``ids``),
    and must also be kept elsewhere until the replicas confirm them."""

    def __init__(self, message: str, ids: list[str | None]) -> None:
        super().__init__(message)
        self.ids = ids


class LogReplaced(Exception):
    """Commits made for a namespace's log that is gone: the namespace was deleted (and perhaps
    created again) since. Not a storage error: storage answered, and the commits must not be
    kept for a retry."""


# ASCII digits only: ``\d`` would also take other scripts' digits, which Redis refuses.
_STREAM_ID = re.compile(r"[0-9]+(-[0-9]+)?")
_MAX_PART = 2**64 - 1  # each part of a stream id is an unsigned 64-bit integer: 20 digits


class LogEntry(NamedTuple):
    """One finished request: its stream id, its tokens (a read-only int32 array) and the key its
    client committed it under ("": none, or an entry appended before entries held keys)."""

    id: str
    tokens: np.ndarray
    key: str = ""


def check_stream_id(stream_id: str) -> str:
    r"""``stream_id`` if Redis takes it as a stream id: ``<ms>-<seq>`` or ``<ms>``, each part
    at most 20 ASCII decimal digits and at most ``2**64 - 1``; else ``ValueError``.

    >>> check_stream_id("1700000000000-3")
    '1700000000000-3'
    >>> check_stream_id("1-18446744073709551616")
    Traceback (most recent call last):
    ...
    ValueError: stream id parts must be at most 18446744073709551615 (20 digits), got '1-18446744073709551616'
    >>> check_stream_id("\u0663")
    Traceback (most recent call last):
    ...
    ValueError: stream id must look like '<ms>-<seq>' or '0', got '\u0663'
    """
    if not isinstance(stream_id, str) or not _STREAM_ID.fullmatch(stream_id):
        raise ValueError(f"stream id must look like '<ms>-<seq>' or '0', got {str(stream_id)[:64]!a}")
    if any(len(part) > 20 or int(part) > _MAX_PART for part in stream_id.split("-")):
        raise ValueError(f"stream id parts must be at most {_MAX_PART} (20 digits), got {stream_id[:64]!r}")
    return stream_id


def position(stream_id: str) -> tuple[int, int]:
    """A stream id as an ordered pair (ids order by milliseconds, then sequence).

    >>> position("1700000000000-3") < position("1700000000000-12")
    True
    """
    ms, _, seq = check_stream_id(stream_id).partition("-")
    return int(ms), int(seq or 0)


def stream_id(pos: tuple[int, int]) -> str:
    """The inverse of :func:`position`."""
    return f"{pos[0]}-{pos[1]}"


def append(script: Script, ns: str, requests: list[np.ndarray], max_tokens: int) -> list[str]:
    """Append requests (keeping the last ``max_tokens`` of an oversized one) and trim."""
    args: list[bytes | int] = [max_tokens]
    for tokens in requests:
        kept = tokens[-max_tokens:] if tokens.size > max_tokens else tokens
        args += [codec.tokens_to_bytes(kept), int(kept.size)]
    ids = script(keys=[keys.log(ns), keys.log_tokens(ns)], args=args)
    return [i.decode() for i in ids]


class KeyWindow(NamedTuple):
    """How long (ms) and how many of its latest commit keys a log keeps."""

    ms: int
    most: int


def append_once(
    script: Script,
    ns: str,
    commits: list[Commit],
    max_tokens: int,
    ttl_s: int,
    log: str = "",
    *,
    window: KeyWindow,
    replicas: tuple[StorageClient, int, int] | None = None,
) -> list[str | None]:
    """Append commits not yet in the log (see :data:`APPEND_ONCE_LUA`) and trim; per commit its
    stream id, or ``None`` when the log held it already (by its id, or by its key among those
    ``window`` keeps). ``log``: the identity of the log they were made for (:class:`LogReplaced`
    when it is not the namespace's log now). ``replicas``: ``(client, count, timeout_ms)``, the
    append then waits (``WAIT``, on its own connection) until ``count`` replicas have it, at most
    ``timeout_ms``; :class:`NotReplicated` when fewer did (a commit the log held already is
    waited for all the same)."""
    args: list[bytes | int | str] = [max_tokens, ttl_s, log, window.ms, window.most]
    for writer, seq, tokens, key in commits:
        kept = tokens[-max_tokens:] if tokens.size > max_tokens else tokens
        args += [codec.tokens_to_bytes(kept), int(kept.size), writer, int(seq), key]
    names = [keys.log(ns), keys.log_tokens(ns), keys.log_writers(ns), keys.log_identity(ns), keys.log_commit_keys(ns)]
    if replicas is None:
        raw, acked, wanted = script(keys=names, args=args), 0, 0
    else:
        client, wanted, timeout_ms = replicas
        pipe = on_one_connection(client, keys.log(ns))
        script(keys=names, args=args, client=pipe)
        pipe.wait(wanted, timeout_ms)
        raw, acked = pipe.execute()
    if raw == [b"replaced"]:
        raise LogReplaced(f"namespace {ns!r}: its log is not the one the commits were made for")
    ids = [i.decode() or None for i in raw]
    if acked < wanted:
        raise NotReplicated(f"namespace {ns!r}: {acked} of {wanted} replicas confirmed the commits", ids)
    return ids


def _entry(raw_id: object, raw_fields: object) -> LogEntry:
    entry_id = codec.as_bytes(raw_id, what="log entry id").decode()
    fields = codec.as_fields(raw_fields, what=f"log entry {entry_id}")
    try:
        n, raw = int(fields[b"n"]), fields[b"tokens"]
    except (KeyError, ValueError) as exc:
        raise StorageCorrupt(f"log entry {entry_id} lacks a valid n/tokens field") from exc
    tokens = codec.tokens_from_bytes(raw, what=f"log entry {entry_id}")
    if tokens.size != n:
        raise StorageCorrupt(f"log entry {entry_id} says n={n} but holds {tokens.size} tokens")
    key = fields.get(b"k", b"")
    if len(key) > MAX_KEY_LEN or not key.isascii():
        raise StorageCorrupt(f"log entry {entry_id} holds a malformed commit key")
    return LogEntry(entry_id, tokens, key.decode())


def read(client: StorageClient, ns: str, after_id: str, count: int) -> list[LogEntry]:
    """Up to ``count`` entries with ids strictly after ``after_id``, oldest first."""
    if position(after_id) == (_MAX_PART, _MAX_PART):
        return []  # Redis refuses an exclusive range from the largest id: none can follow it
    rows = client.xrange(keys.log(ns), min="(" + after_id, max="+", count=count)
    return [_entry(i, f) for i, f in rows or []]


def last_id(client: StorageClient, ns: str) -> str:
    """The id of the log's newest entry (``"0-0"`` while it is empty)."""
    rows = client.xrevrange(keys.log(ns), max="+", min="-", count=1)
    if not rows:
        return "0-0"
    return codec.as_bytes(rows[0][0], what="log entry id").decode()


def follow(client: StorageClient, ns: str, last_id: str, block_ms: int | None, count: int) -> list[LogEntry]:
    """Entries after ``last_id`` (or ``"$"``: only new ones), waiting up to ``block_ms``."""
    if last_id != "$":
        check_stream_id(last_id)
    reply = client.xread({keys.log(ns): last_id}, count=count, block=block_ms)
    return [_entry(i, f) for entries in _reply_entries(reply) for i, f in entries]


def _reply_entries(reply: object) -> list[list[tuple[object, object]]]:
    """XREAD's entries per stream: RESP2 answers ``[[stream, entries]]``, RESP3
    ``{stream: [entries]}``, and both answer an empty container on a timeout."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [v[0] if v and isinstance(v[0], list) else v for v in reply.values()]
    if not isinstance(reply, list):
        raise StorageCorrupt(f"unexpected XREAD reply of type {type(reply).__name__}")
    return [entries for _, entries in reply]


def size(client: StorageClient, ns: str) -> tuple[int, int]:
    """``(entries, tokens)`` currently in the log."""
    with transaction(client, keys.log(ns)) as pipe:
        pipe.xlen(keys.log(ns))
        pipe.get(keys.log_tokens(ns))
        entries, tokens = pipe.execute()
    try:
        return int(entries), int(tokens or 0)
    except ValueError as exc:
        raise StorageCorrupt(f"token counter of {keys.log(ns)} is not an integer: {tokens!r}") from exc

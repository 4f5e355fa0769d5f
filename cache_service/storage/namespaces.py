"""Deleting a namespace from storage: its registration, every key tagged with it (lifetime log
and its counters, priors and their versions) and the stored sessions that belong to it.

The registration goes first, so no replica discovers the namespace again while the rest goes.
A namespace's own keys share one hash slot and are found with SCAN (never KEYS) and unlinked a
batch at a time; sessions are tagged by their own ids, so they are found by scanning the
session state keys and reading each one's namespace (per session on a cluster, where they live
on different nodes). Deleting again finishes an interrupted deletion.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.cluster import RedisCluster

from cache_service.storage import keys, sessions
from cache_service.storage.clients import StorageClient


@dataclass(frozen=True)
class Deleted:
    """What a deletion removed: whether the namespace was registered, its keys, its stored
    sessions."""

    registered: bool
    keys: int
    sessions: int


def delete(client: StorageClient, ns: str, batch: int) -> Deleted:
    """Remove everything storage keeps of namespace ``ns``; ``batch``: keys per SCAN step."""
    registered = bool(client.hdel(keys.NAMESPACES, keys.check_name(ns, what="namespace")))
    removed = 0
    found: list[bytes] = []
    for key in client.scan_iter(match=keys.namespace_pattern(ns), count=batch):
        found.append(key)
        if len(found) >= batch:
            removed += int(client.unlink(*found))  # one slot: legal on a cluster
            found = []
    if found:
        removed += int(client.unlink(*found))
    return Deleted(registered, removed, len(_delete_sessions(client, ns, batch)))


def _delete_sessions(client: StorageClient, ns: str, batch: int) -> list[str]:
    """Delete the stored sessions of namespace ``ns``; their ids."""
    gone: list[str] = []
    page: list[str] = []
    for key in client.scan_iter(match=keys.session_state_pattern(), count=batch):
        page.append(keys.tag_of(key))
        if len(page) >= batch:
            gone += _delete_page(client, ns, page)
            page = []
    if page:
        gone += _delete_page(client, ns, page)
    return gone


def _delete_page(client: StorageClient, ns: str, sids: list[str]) -> list[str]:
    """Of ``sids``, delete the sessions stored under namespace ``ns``."""
    if isinstance(client, RedisCluster):
        owners = [client.hget(keys.session_state(sid), "namespace") for sid in sids]
    else:
        pipe = client.pipeline(transaction=False)
        for sid in sids:
            pipe.hget(keys.session_state(sid), "namespace")
        owners = pipe.execute()
    mine = [sid for sid, owner in zip(sids, owners, strict=True) if owner == ns.encode()]
    if mine:
        sessions.delete_many(client, mine)
    return mine

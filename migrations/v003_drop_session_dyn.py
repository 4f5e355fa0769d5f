"""v3: sessions lose their dynamic-table key.

Up to v2 every session save also wrote ``draftcache:v1:session:{<sid>}:dyn``, always an empty
table: a session's dynamic tier is read off its context tokens, so loading ignored the key. From
v3 nothing writes or reads it; this step deletes the ones still held (they would otherwise
linger until their sessions expire). SCAN, never KEYS, so Redis keeps serving meanwhile;
re-running it finds nothing left to delete.
"""

from __future__ import annotations

from migrations import keys
from migrations.base import Migration
from migrations.clients import Client

BATCH = 1000  # keys per SCAN step and per pipelined round of deletes


def apply(client: Client) -> None:
    found = client.scan_iter(match=keys.V1_SESSION_DYN_PATTERN, count=BATCH, _type="string")
    pipe = client.pipeline(transaction=False)  # one key per command: legal across cluster slots
    queued = 0
    for key in found:
        pipe.delete(key)
        queued += 1
        if queued == BATCH:
            pipe.execute()
            queued = 0
    if queued:
        pipe.execute()


MIGRATION = Migration(version=3, description="session dynamic-table keys dropped (never read)", apply=apply)

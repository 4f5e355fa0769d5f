"""The clients the store runs on (one Redis, a Sentinel-managed master, a Redis Cluster) and the
one way it opens a transaction on any of them.

On a cluster a transaction may only touch keys of one hash slot; every key of a namespace, and
every key of a session, shares a slot (see :mod:`cache_service.storage.keys`), so each
transaction names the key whose slot it runs in.
"""

from __future__ import annotations

from typing import TypeAlias

import redis
import redis.cluster
from redis.client import Pipeline
from redis.cluster import ClusterPipeline, RedisCluster

StorageClient: TypeAlias = redis.Redis | RedisCluster
Transaction: TypeAlias = Pipeline | ClusterPipeline

# redis-py runs MULTI/EXEC (and WATCH) through a ClusterPipeline only since it grew a transaction
# strategy (6.x); before that a cluster transaction goes straight to the node owning the slot.
CLUSTER_TRANSACTIONS = hasattr(redis.cluster, "TransactionStrategy")


def transaction(client: StorageClient, key: str) -> Transaction:
    """A MULTI/EXEC pipeline for commands on ``key``'s hash slot (use it as a context manager).

    On one Redis (or a Sentinel master) this is ``client.pipeline(transaction=True)``; on a
    cluster it is the cluster pipeline's transaction where redis-py has one
    (:data:`CLUSTER_TRANSACTIONS`), else a plain transaction on the node that owns the slot.

    >>> with transaction(client, keys.session_state("s")) as pipe:  # doctest: +SKIP
    ...     pipe.hgetall(keys.session_state("s"))
    ...     pipe.get(keys.session_rej("s"))
    ...     fields, rej = pipe.execute()
    """
    if not isinstance(client, RedisCluster) or CLUSTER_TRANSACTIONS:
        return client.pipeline(transaction=True)
    node = client.get_node_from_key(key)
    return client.get_redis_connection(node).pipeline(transaction=True)


def on_one_connection(client: StorageClient, key: str) -> Pipeline:
    """A pipeline (no transaction) whose commands go down one connection to the server holding
    ``key``'s slot, the master on a cluster: what ``WAIT`` needs, since it waits for the writes
    made on its own connection.

    >>> pipe = on_one_connection(client, keys.log("llama2"))  # doctest: +SKIP
    >>> pipe.set(keys.log_tokens("llama2"), 0); pipe.wait(1, 500); pipe.execute()  # doctest: +SKIP
    [True, 1]
    """
    if isinstance(client, RedisCluster):
        client = client.get_redis_connection(client.get_node_from_key(key))
    return client.pipeline(transaction=False)

"""The Redis clients a migration runs on: one server (or a Sentinel master) or a Redis Cluster."""

from __future__ import annotations

from typing import TypeAlias

import redis
from redis.cluster import RedisCluster

Client: TypeAlias = redis.Redis | RedisCluster

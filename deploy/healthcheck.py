"""Health check for containers and scripts: exit 0 when draftcache answers SERVING on the
standard ``grpc.health.v1`` service, 1 otherwise (NOT_SERVING while loading or draining,
unreachable, timed out).

    python healthcheck.py                              # the service of DRAFTCACHE_HOST / DRAFTCACHE_PORT
    python healthcheck.py 10.0.0.5:50051               # any target
    python healthcheck.py --service draftcache.v1.DraftCache

It needs only grpcio and grpcio-health-checking, which the service depends on anyway, so an
image needs nothing else (no grpc_health_probe binary). The Dockerfile and docker-compose.yml
run it; Kubernetes uses its native ``grpc:`` probes against the same service.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# A server bound to every interface is reached on loopback from inside its own container.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def default_target(env: Mapping[str, str]) -> str:
    """Where ``draftcache serve`` listens, read from the same variables it reads.

    >>> default_target({"DRAFTCACHE_HOST": "0.0.0.0", "DRAFTCACHE_PORT": "6000"})
    '127.0.0.1:6000'
    >>> default_target({"DRAFTCACHE_HOST": "::1"})
    '[::1]:50051'
    """
    host = env.get("DRAFTCACHE_HOST", "127.0.0.1")
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{env.get('DRAFTCACHE_PORT', '50051')}"


def check(target: str, service: str = "", timeout_s: float = 2.0) -> str:
    """The status name the server reports for ``service`` ("" is the server as a whole), or
    the gRPC code name when the call fails."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return code.name if code is not None else "UNAVAILABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("target", nargs="?", default=None, help="host:port (default: DRAFTCACHE_HOST/PORT)")
    parser.add_argument("--service", default="", help="a service name; default: the server as a whole")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds")
    args = parser.parse_args(argv)
    target = args.target or default_target(os.environ)
    status = check(target, args.service, args.timeout)
    print(f"{target} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())

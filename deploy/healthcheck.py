"""Health check for containers and scripts: exit 0 when draftcache answers SERVING on the
standard ``grpc.health.v1`` service, 1 otherwise (NOT_SERVING while loading or draining,
unreachable, timed out, a TLS handshake refused).

    python healthcheck.py                              # the service of DRAFTCACHE_HOST / DRAFTCACHE_PORT
    python healthcheck.py 10.0.0.5:50051               # any target
    python healthcheck.py --service draftcache.v1.DraftCache

It reads the variables ``draftcache serve`` reads, so beside the server (a container's
HEALTHCHECK, an exec probe) it needs no settings of its own. Where the server serves TLS
(``DRAFTCACHE_TLS_CERT``), the check does too, trusting ``DRAFTCACHE_TLS_CA`` (``--tls-ca``, the
variable of ``draftcache stats --tls-ca``), else the certificate the server serves; where the
server requires client certificates (``DRAFTCACHE_TLS_CLIENT_CA``), it presents
``--tls-client-cert/--tls-client-key``, else the server's own pair. A certificate that does not
name the target's host (127.0.0.1) is checked against ``DRAFTCACHE_TLS_SERVER_NAME``
(``--tls-server-name``). Bearer tokens are not needed: health is open to every caller.

The answer is SERVING through a Redis outage: drafts are served from memory and commits are
journaled under ``--data-dir`` until Redis is back (watch ``draftcache_storage_up`` and
``draftcache_journal_bytes`` instead), since neither restarting nor unreadying a replica would
bring Redis back, and both would cost the sessions it holds.

It needs only grpcio and grpcio-health-checking, which the service depends on anyway, so an
image needs nothing else (no grpc_health_probe binary). The Dockerfile and docker-compose.yml
run it; Kubernetes uses its native ``grpc:`` probes against the same service (plaintext only:
with TLS, exec probes run this script, as deploy/k8s/overlays/tls does).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# A server bound to every interface is reached on loopback from inside its own container.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
# Below the 5 s that the Dockerfile's HEALTHCHECK and the Compose file give the whole check
# (the interpreter's start included), so that the check's own verdict is the one reported.
DEFAULT_TIMEOUT_S = 4.0


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


@dataclass(frozen=True)
class Tls:
    """How to reach a server over TLS: the roots to trust, a client pair, the name to check."""

    ca: Path
    client_cert: Path | None = None
    client_key: Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        pair = (None, None)
        if self.client_cert is not None and self.client_key is not None:
            pair = (self.client_key.read_bytes(), self.client_cert.read_bytes())
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), *pair)

    def options(self) -> list[tuple[str, str]]:
        return [] if not self.server_name else [("grpc.ssl_target_name_override", self.server_name)]


def tls_from(args: argparse.Namespace, env: Mapping[str, str]) -> Tls | None:
    """TLS as the server's variables and the flags say; None: plaintext.

    >>> tls_from(argparse.Namespace(tls_ca=None, tls_client_cert=None, tls_client_key=None,
    ...     tls_server_name=None), {"DRAFTCACHE_TLS_CERT": "s.pem", "DRAFTCACHE_TLS_KEY": "s.key"})
    Tls(ca=PosixPath('s.pem'), client_cert=None, client_key=None, server_name=None)
    """
    served = env.get("DRAFTCACHE_TLS_CERT") or None
    ca = args.tls_ca or env.get("DRAFTCACHE_TLS_CA") or served
    if not ca:
        return None
    cert, key = args.tls_client_cert, args.tls_client_key
    if (cert is None) != (key is None):
        raise ValueError("--tls-client-cert and --tls-client-key go together")
    if cert is None and env.get("DRAFTCACHE_TLS_CLIENT_CA") and served and env.get("DRAFTCACHE_TLS_KEY"):
        cert, key = served, env["DRAFTCACHE_TLS_KEY"]  # mutual TLS: the server's own pair
    name = args.tls_server_name or env.get("DRAFTCACHE_TLS_SERVER_NAME") or None
    return Tls(Path(ca), None if cert is None else Path(cert), None if key is None else Path(key), name)


def check(target: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S, tls: Tls | None = None) -> str:
    """The status name the server reports for ``service`` ("" is the server as a whole), or
    the gRPC code name (and its details) when the call fails."""
    if tls is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, tls.credentials(), options=tls.options())
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else ""
            name = code.name if code is not None else "UNAVAILABLE"
            return f"{name} ({details})" if details and name != "DEADLINE_EXCEEDED" else name
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("target", nargs="?", default=None, help="host:port (default: DRAFTCACHE_HOST/PORT)")
    parser.add_argument("--service", default="", help="a service name; default: the server as a whole")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    parser.add_argument("--tls-ca", help="PEM roots to trust (default: DRAFTCACHE_TLS_CA, else DRAFTCACHE_TLS_CERT)")
    parser.add_argument("--tls-client-cert", help="PEM client certificate, for a server that requires one")
    parser.add_argument("--tls-client-key", help="its PEM private key")
    parser.add_argument("--tls-server-name", help="the name the certificate must carry (DRAFTCACHE_TLS_SERVER_NAME)")
    args = parser.parse_args(argv)
    target = args.target or default_target(os.environ)
    try:
        tls = tls_from(args, os.environ)
        status = check(target, args.service, args.timeout, tls)
    except (OSError, ValueError) as exc:  # a TLS file missing or unreadable, a half pair
        status = f"ERROR ({exc})"
    print(f"{target} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())

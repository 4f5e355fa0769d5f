"""The gRPC server: servicers, the error interceptor, health, reflection, graceful shutdown."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cache_service.config import ServerConfig
from cache_service.domain.ports import StorageHealth
from cache_service.domain.service import DraftService
from cache_service.rpc.auth import AuthInterceptor, TokenTable
from cache_service.rpc.interceptor import ErrorInterceptor, Observer
from cache_service.rpc.servicer import AdminServicer, DraftCacheServicer

logger = logging.getLogger(__name__)

SERVICES = (pb.DESCRIPTOR.services_by_name["DraftCache"].full_name, pb.DESCRIPTOR.services_by_name["Admin"].full_name)


class Server:
    """A started gRPC server and its health status.

    ``port`` is the bound port (``ServerConfig(port=0)`` picks a free one).
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        health_servicer: health.aio.HealthServicer,
        drafts: DraftCacheServicer | None = None,
    ) -> None:
        self.grpc = server
        self.port = port
        self.health = health_servicer
        self.drafts = drafts

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, end the streams (each after the message it is answering), let
        in-flight calls drain for ``grace_s``, then stop."""
        await self.set_serving(False)
        if self.drafts is not None:
            self.drafts.drain()
        await self.grpc.stop(grace_s)
        logger.info("server on port %d stopped", self.port)


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (and with a client CA, mutual TLS) from the configured PEM files; None: plaintext."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    pair = (config.tls_key_file.read_bytes(), config.tls_cert_file.read_bytes())
    ca = config.tls_client_ca_file.read_bytes() if config.tls_client_ca_file is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def check_files(config: ServerConfig) -> None:
    """Read the token file and the TLS files now: ``ValueError`` or ``OSError`` says what is
    wrong, before anything is started."""
    if config.tokens_file is not None:
        TokenTable.load(config.tokens_file)
    server_credentials(config)


async def create_server(
    config: ServerConfig,
    service: DraftService,
    observe: Observer | None = None,
    *,
    storage_health: Callable[[], StorageHealth] | None = None,
) -> Server:
    """Build, bind and start the server; health starts NOT_SERVING until the caller says so.
    ``observe`` receives every call's method, status and duration (metrics); ``storage_health``
    what Stats reports of storage."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", int(config.shared_port)),
    ]
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor(observe)]
    if config.tokens_file is not None:
        interceptors.append(AuthInterceptor(TokenTable.load(config.tokens_file)))
    server = grpc.aio.server(interceptors=interceptors, options=options)
    drafts = DraftCacheServicer(service, observe)
    pb_grpc.add_DraftCacheServicer_to_server(drafts, server)
    pb_grpc.add_AdminServicer_to_server(AdminServicer(service, storage_health), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    credentials = server_credentials(config)

    def bind(port: int) -> int:
        address = f"{config.host}:{port}"
        try:
            if credentials is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, credentials)
        except RuntimeError as exc:  # how newer grpc releases say it
            raise OSError(f"could not bind {address}: {exc}") from exc
        if bound == 0:
            raise OSError(f"could not bind {address}")
        return bound

    port = bind(config.port)
    if config.own_port is not None:
        bind(config.own_port)
    await server.start()
    started = Server(server, port, health_servicer, drafts)
    await started.set_serving(False)
    own = "" if config.own_port is None else f" and {config.host}:{config.own_port} (this process alone)"
    logger.info("draftcache listening on %s:%d%s", config.host, port, own)
    return started

"""A running service's namespaces, as the tools need them: made where missing, and asked for the
vocabulary they hold. Plain channels: the tools talk to a service on the same host or network."""

from __future__ import annotations

from indexer.tokens import Namespace

ADMIN_TIMEOUT_S = 30.0


def ensure_namespace(target: str, namespace: Namespace, *, wait: bool = False) -> None:
    """Create ``namespace`` on the service at ``target`` (a no-op when it exists alike). With
    ``wait``, a service not yet up is waited for (up to the call's 30 s) rather than refused at once:
    for tools that start the service themselves."""
    import grpc
    from draftcache.v1 import draftcache_pb2 as pb
    from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        request = pb.CreateNamespaceRequest(name=namespace.name, vocab_size=namespace.vocab_size)
        pb_grpc.AdminStub(channel).CreateNamespace(request, timeout=ADMIN_TIMEOUT_S, wait_for_ready=wait)


def service_vocab(target: str, name: str) -> int | None:
    """The vocabulary the service at ``target`` holds for namespace ``name`` (None: no such namespace)."""
    import grpc
    from draftcache.v1 import draftcache_pb2 as pb
    from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            stats = pb_grpc.AdminStub(channel).Stats(pb.StatsRequest(namespace=name), timeout=ADMIN_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
    return next((int(i.vocab_size) for i in stats.namespaces if i.name == name), None)

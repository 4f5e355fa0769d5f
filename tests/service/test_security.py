"""Authentication, roles, tenant isolation, per-tenant limits and TLS on a real server."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.config import ServerConfig, ServiceConfig
from cache_service.domain.service import DraftService
from cache_service.rpc.auth import TokenTable
from cache_service.rpc.server import create_server
from decoder_client.client import ClientConfig, DraftClient

TOKENS = {
    "tokens": [
        {"token": "tok-a", "tenant": "a", "role": "decoder", "namespaces": ["ns-a", "shared"]},
        {"token": "tok-b", "tenant": "b", "role": "decoder", "namespaces": ["ns-b", "shared"]},
        {"token": "tok-small", "tenant": "small", "role": "decoder", "namespaces": ["ns-b"]},
        {"token": "tok-admin-a", "tenant": "a", "role": "admin", "namespaces": ["ns-a"]},
        {"token": "tok-ops", "tenant": "ops", "role": "admin"},
    ],
    "limits": {"small": {"max_sessions": 2, "max_session_tokens": 100}},
}


@dataclass
class Served:
    target: str
    service: DraftService
    loop: asyncio.AbstractEventLoop
    server: object

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)


def _serve(config: ServerConfig) -> Served:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    service = DraftService(ServiceConfig())
    server = asyncio.run_coroutine_threadsafe(create_server(config, service), loop).result(30)
    asyncio.run_coroutine_threadsafe(server.set_serving(True), loop).result(5)
    return Served(f"{config.host}:{server.port}", service, loop, server)


def _stop(s: Served) -> None:
    asyncio.run_coroutine_threadsafe(s.server.stop(0.2), s.loop).result(10)  # type: ignore[attr-defined]
    s.loop.call_soon_threadsafe(s.loop.stop)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(TOKENS))
    s = _serve(ServerConfig(port=0, tokens_file=path))
    for name in ("ns-a", "ns-b", "shared"):
        s.service.create_namespace(name, 1000)
    yield s
    _stop(s)


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def _open(stub: pb_grpc.DraftCacheStub, token: str, ns: str, prompt: list[int]) -> str:
    req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=ns, prompt=prompt)])
    return stub.OpenSessions(req, metadata=_md(token)).session_ids[0]


def test_callers_need_a_known_token_and_admin_calls_an_admin_token(served: Served) -> None:
    with served.channel() as ch:
        stub, admin = pb_grpc.DraftCacheStub(ch), pb_grpc.AdminStub(ch)
        req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns-a", prompt=[1, 2])])
        assert _code(lambda: stub.OpenSessions(req)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: stub.OpenSessions(req, metadata=_md("nope"))) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: stub.Stream(iter([]), metadata=_md("nope")).next()) == grpc.StatusCode.UNAUTHENTICATED
        # A decoder token cannot call the admin service; an admin token can.
        stats = pb.StatsRequest()
        assert _code(lambda: admin.Stats(stats, metadata=_md("tok-a"))) == grpc.StatusCode.PERMISSION_DENIED
        assert {n.name for n in admin.Stats(stats, metadata=_md("tok-ops")).namespaces} == {"ns-a", "ns-b", "shared"}
        # A tenant's admin sees and manages only its own namespaces.
        assert [n.name for n in admin.Stats(stats, metadata=_md("tok-admin-a")).namespaces] == ["ns-a"]
        create = pb.CreateNamespaceRequest(name="ns-b2", vocab_size=10)
        assert (
            _code(lambda: admin.CreateNamespace(create, metadata=_md("tok-admin-a")))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        # Health needs no token (probes).
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_tenants_never_draft_from_each_others_history(served: Served) -> None:
    planted = [901, 902, 903, 904, 905, 906, 907, 908]  # a sequence only tenant a ever sees
    with served.channel() as ch:
        stub = pb_grpc.DraftCacheStub(ch)
        sid = _open(stub, "tok-a", "ns-a", [1, 2, 3, *planted])
        close = pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)])
        stub.CloseSessions(close, metadata=_md("tok-a"))
        # Tenant a's next request is drafted from its history ...
        mine = _open(stub, "tok-a", "ns-a", [7, 7, *planted[:3]])
        tree = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=mine)]), metadata=_md("tok-a")).trees[0]
        assert list(tree.tokens[:3]) == planted[3:6]
        # ... tenant b's, with the same context, never sees it.
        theirs = _open(stub, "tok-b", "ns-b", [7, 7, *planted[:3]])
        tree = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=theirs)]), metadata=_md("tok-b")).trees[0]
        assert not set(tree.tokens) & set(planted[3:])
        # b can neither open in a's namespace nor use a's session (whose existence is not disclosed).
        req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="ns-a", prompt=[1])])
        assert _code(lambda: stub.OpenSessions(req, metadata=_md("tok-b"))) == grpc.StatusCode.PERMISSION_DENIED
        steal = pb.DraftRequest(items=[pb.DraftItem(session_id=mine)])
        assert _code(lambda: stub.Draft(steal, metadata=_md("tok-b"))) == grpc.StatusCode.NOT_FOUND
        # Session ids are 128 random bits.
        assert len(mine) == 32 and int(mine, 16) >= 0 and mine != theirs


def test_another_tenants_live_session_is_answered_as_an_unknown_one(served: Served) -> None:
    """Even in a namespace both tenants may use, b learns nothing of a's session: opening with
    its id, drafting, feeding back and closing it all get what an unknown id gets."""
    sid, unknown = "a-chose-this-id-0001", "nobody-has-this-id-01"
    with served.channel() as ch:
        stub = pb_grpc.DraftCacheStub(ch)
        req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="shared", prompt=[1, 2, 3], session_id=sid)])
        assert list(stub.OpenSessions(req, metadata=_md("tok-a")).session_ids) == [sid]

        def refusals(target: str, names: tuple[str, ...]) -> dict[str, tuple[grpc.StatusCode, str]]:
            calls = {
                "open": lambda: stub.OpenSessions(
                    pb.OpenSessionsRequest(
                        sessions=[pb.OpenSession(namespace="shared", prompt=[7], session_id=target)]
                    ),
                    metadata=_md("tok-b"),
                ),
                "draft": lambda: stub.Draft(
                    pb.DraftRequest(items=[pb.DraftItem(session_id=target)]), metadata=_md("tok-b")
                ),
                "feedback": lambda: stub.Feedback(
                    pb.FeedbackRequest(items=[pb.FeedbackItem(session_id=target, accepted=[4])]), metadata=_md("tok-b")
                ),
                "close": lambda: stub.CloseSessions(
                    pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=target)]), metadata=_md("tok-b")
                ),
            }
            out = {}
            for name in names:
                with pytest.raises(grpc.RpcError) as err:
                    calls[name]()
                out[name] = (err.value.code(), err.value.details().replace(target, "<id>"))
            return out

        every = ("open", "draft", "feedback", "close")
        assert refusals(sid, every) == dict.fromkeys(
            every, (grpc.StatusCode.NOT_FOUND, "unknown or expired session '<id>'")
        )
        # An unknown id gets the same answers from the calls that do not create one.
        assert refusals(sid, every[1:]) == refusals(unknown, every[1:])
        # a's session is as it was: its context only, drafted from and closed by a.
        entry = served.service.sessions.get(sid)
        assert (entry.tenant, entry.session.context.tokens.tolist()) == ("a", [1, 2, 3])
        stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid)]), metadata=_md("tok-a"))


def test_tenants_configured_to_share_a_namespace_share_its_history(served: Served) -> None:
    planted = [801, 802, 803, 804, 805, 806]
    with served.channel() as ch:
        stub = pb_grpc.DraftCacheStub(ch)
        sid = _open(stub, "tok-a", "shared", [1, *planted])
        close = pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)])
        stub.CloseSessions(close, metadata=_md("tok-a"))
        other = _open(stub, "tok-b", "shared", [5, *planted[:2]])
        tree = stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=other)]), metadata=_md("tok-b")).trees[0]
        assert list(tree.tokens[:2]) == planted[2:4]


def test_per_tenant_session_and_token_limits(served: Served) -> None:
    with served.channel() as ch:
        stub = pb_grpc.DraftCacheStub(ch)
        first = _open(stub, "tok-small", "ns-b", [1] * 40)
        _open(stub, "tok-small", "ns-b", [2] * 40)
        # A third session is one too many for this tenant; other tenants are unaffected.
        code = _code(lambda: _open(stub, "tok-small", "ns-b", [3]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        _open(stub, "tok-b", "ns-b", [3])
        # Closing one frees a slot, but 40 + 70 tokens would pass the tenant's 100.
        close = pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=first)])
        stub.CloseSessions(close, metadata=_md("tok-small"))
        assert _code(lambda: _open(stub, "tok-small", "ns-b", [4] * 70)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        _open(stub, "tok-small", "ns-b", [4] * 50)


def test_a_tenants_token_limit_holds_as_its_sessions_grow(served: Served) -> None:
    """The tokens a tenant's sessions hold count what drafts and feedback add, not only the
    prompts: a call that would pass the limit is refused whole, and the session is unchanged."""
    with served.channel() as ch:
        stub = pb_grpc.DraftCacheStub(ch)
        sid = _open(stub, "tok-small", "ns-b", [1] * 40)
        draft = pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[5] * 50)])
        stub.Draft(draft, metadata=_md("tok-small"))  # 90 of 100
        more = pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[6] * 20)])
        assert _code(lambda: stub.Draft(more, metadata=_md("tok-small"))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        fed = pb.FeedbackRequest(items=[pb.FeedbackItem(session_id=sid, accepted=[7] * 11)])
        assert _code(lambda: stub.Feedback(fed, metadata=_md("tok-small"))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        last = pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[8] * 10)])
        stub.Draft(last, metadata=_md("tok-small"))  # 100: the limit itself
        assert _code(lambda: _open(stub, "tok-small", "ns-b", [9])) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 100 held
        close = pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid)])
        stub.CloseSessions(close, metadata=_md("tok-small"))
        _open(stub, "tok-small", "ns-b", [9] * 100)  # all of it free again


def test_token_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        TokenTable.from_dict({"tokens": []})
    with pytest.raises(ValueError, match="exactly one of token or token_sha256"):
        TokenTable.from_dict({"tokens": [{"tenant": "t"}]})
    with pytest.raises(ValueError, match="role must be"):
        TokenTable.from_dict({"tokens": [{"token": "x", "tenant": "t", "role": "root"}]})
    with pytest.raises(ValueError, match="repeats"):
        TokenTable.from_dict({"tokens": [{"token": "x", "tenant": "t"}, {"token": "x", "tenant": "u"}]})
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable token file"):
        TokenTable.load(bad)
    # A token given by its SHA-256 authenticates the plain token.
    import hashlib

    table = TokenTable.from_dict({"tokens": [{"token_sha256": hashlib.sha256(b"pw").hexdigest(), "tenant": "t"}]})
    assert table.principal("pw") is not None and table.principal("pw2") is None


# -- TLS ---------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=test-ca", cwd=tmp_path)  # fmt: skip
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=tmp_path)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=tmp_path)  # fmt: skip
    return tmp_path


def test_tls_and_mutual_tls(pki: Path) -> None:
    server_config = ServerConfig(
        port=0,
        tls_cert_file=pki / "server.pem",
        tls_key_file=pki / "server.key",
        tls_client_ca_file=pki / "ca.pem",
    )
    s = _serve(server_config)
    s.service.create_namespace("ns", 100)
    try:
        base = {"target": s.target, "namespace": "ns", "deadline_s": 2.0, "control_timeout_s": 2.0}
        with_cert = ClientConfig(
            **base,
            tls_root_cert_file=str(pki / "ca.pem"),
            tls_cert_file=str(pki / "client.pem"),
            tls_key_file=str(pki / "client.key"),
        )
        client = DraftClient(with_cert)
        (session,) = client.open([[5, 6, 7, 5, 6]])
        (tree,) = client.draft([session], [[]])
        assert tree.tokens[0] == 7 and client.stats.remote == 1
        client.shutdown()
        # Without a client certificate (mTLS required) or over plaintext, no call gets through.
        for config in (ClientConfig(**base, tls_root_cert_file=str(pki / "ca.pem")), ClientConfig(**base)):
            other = DraftClient(config)
            (session,) = other.open([[5, 6, 7, 5, 6]])
            other.draft([session], [[]])
            assert other.stats.remote == 0 and other.stats.fallback == 1
            other.shutdown()
    finally:
        _stop(s)

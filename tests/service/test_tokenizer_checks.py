"""A caller's tokenizer against its namespace's, by fingerprint (indexer.fingerprint): two
tokenizers of one size (Llama-2's and Mistral-7B-v0.1's both have 32,000 ids) pass the
vocabulary check, and only the fingerprint tells them apart. The first fingerprint stated when
creating a namespace (or by ``draftcache warm``) is registered with it in storage; every replica
then refuses opens and log and prior reads stating another, until the namespace is deleted.
A real service on a real Redis."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.app import connect
from cache_service.storage.redis_store import RedisStore
from decoder_client.client import ClientConfig
from tests.service.conftest import Replica, ended_requests, eventually, replica_with_namespace

NS = "toy"
VOCAB = 100
OURS, THEIRS = "0123456789abcdef", "fedcba9876543210"  # two tokenizers of VOCAB ids
PROMPT = [5, 17, 23, 42, 8, 15, 1, 2, 5, 17]  # prompt lookup drafts "23 42 8" after "5 17"
ANSWER = list(range(40, 60))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Replica, str]]:
    """A replica whose namespace has our tokenizer registered, and the Redis URL."""
    with replica_with_namespace(tmp_path, NS, VOCAB) as (r, url):
        r.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NS, vocab_size=VOCAB, tokenizer=OURS))
        yield r, url


def _calls(r: Replica, tokenizer: str) -> dict[str, Callable[[], object]]:
    """An open, a log read and a prior read, each stating ``tokenizer`` (and the right size)."""
    return {
        "open": lambda: r.stub.OpenSessions(
            pb.OpenSessionsRequest(
                sessions=[pb.OpenSession(namespace=NS, prompt=PROMPT, vocab_size=VOCAB, tokenizer=tokenizer)]
            )
        ),
        "log": lambda: r.stub.ReadLog(
            pb.ReadLogRequest(namespace=NS, after="0", max_tokens=100, vocab_size=VOCAB, tokenizer=tokenizer)
        ),
        "prior": lambda: r.stub.ReadPrior(
            pb.ReadPriorRequest(namespace=NS, max_bytes=16, vocab_size=VOCAB, tokenizer=tokenizer)
        ),
    }


def _refused(calls: dict[str, Callable[[], object]], code: grpc.StatusCode) -> None:
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is code, name


def _served(calls: dict[str, Callable[[], object]]) -> None:
    for call in calls.values():
        call()


@pytest.mark.parametrize("stated", ["", OURS], ids=["not-stated", "the-namespaces"])
def test_calls_stating_no_tokenizer_or_the_namespaces_are_served(served: tuple[Replica, str], stated: str) -> None:
    replica, _ = served
    _served(_calls(replica, stated))
    (info,) = replica.admin.Namespaces(pb.NamespacesRequest()).namespaces
    assert info.tokenizer == OURS


def test_calls_stating_another_tokenizer_of_the_same_size_are_refused(served: tuple[Replica, str]) -> None:
    replica, _ = served
    _refused(_calls(replica, THEIRS), grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(grpc.RpcError) as refused:
        _calls(replica, THEIRS)["open"]()
    assert OURS in refused.value.details() and THEIRS in refused.value.details()
    assert replica.admin.Stats(pb.StatsRequest(namespace=NS)).namespaces[0].sessions == 0
    _refused(_calls(replica, "not a fingerprint"), grpc.StatusCode.INVALID_ARGUMENT)


def test_the_first_tokenizer_registered_stays(served: tuple[Replica, str]) -> None:
    replica, url = served
    again = pb.CreateNamespaceRequest(name=NS, vocab_size=VOCAB, tokenizer=OURS)
    assert replica.admin.CreateNamespace(again).namespace.tokenizer == OURS  # idempotent
    with pytest.raises(grpc.RpcError) as refused:
        replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NS, vocab_size=VOCAB, tokenizer=THEIRS))
    assert refused.value.code() is grpc.StatusCode.ALREADY_EXISTS and OURS in refused.value.details()
    assert RedisStore(connect(url)).tokenizers([NS]) == {NS: OURS}
    # A namespace created without one takes the first stated later (a namespace of an older
    # service, or one an engine created before it stated its tokenizer).
    replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name="plain", vocab_size=VOCAB))
    _served({"open": lambda: replica.stub.OpenSessions(
        pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="plain", prompt=PROMPT, tokenizer=THEIRS)])
    )})  # fmt: skip
    replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name="plain", vocab_size=VOCAB, tokenizer=THEIRS))
    with pytest.raises(grpc.RpcError) as refused:
        replica.stub.OpenSessions(
            pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="plain", prompt=PROMPT, tokenizer=OURS)])
        )
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_every_replica_refuses_another_tokenizer_and_a_deleted_namespace_forgets_it(
    served: tuple[Replica, str],
) -> None:
    replica, url = served
    other = Replica(url)  # restored from storage at its start
    try:
        _refused(_calls(other, THEIRS), grpc.StatusCode.FAILED_PRECONDITION)
        # Registered through one replica after the other started: the other learns it.
        replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name="later", vocab_size=VOCAB))
        eventually(lambda: "later" in _tokenizers(other))
        replica.admin.CreateNamespace(pb.CreateNamespaceRequest(name="later", vocab_size=VOCAB, tokenizer=OURS))
        eventually(lambda: _tokenizers(other).get("later") == OURS)
        with pytest.raises(grpc.RpcError) as refused:
            other.stub.ReadLog(pb.ReadLogRequest(namespace="later", after="0", max_tokens=10, tokenizer=THEIRS))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        # Deleted and created again with the other tokenizer: both replicas serve that one.
        other.admin.DeleteNamespace(pb.DeleteNamespaceRequest(name=NS))
        other.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NS, vocab_size=VOCAB, tokenizer=THEIRS))
        _served(_calls(other, THEIRS))
        eventually(lambda: _answers(replica, THEIRS) and not _answers(replica, OURS))
    finally:
        other.stop()


def _tokenizers(r: Replica) -> dict[str, str]:
    """The namespaces ``r`` serves, each with its registered tokenizer ("": none)."""
    return {n.name: n.tokenizer for n in r.admin.Namespaces(pb.NamespacesRequest()).namespaces}


def _answers(r: Replica, tokenizer: str) -> bool:
    try:
        _calls(r, tokenizer)["log"]()
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
            return False
        raise
    return True


def test_a_client_of_another_tokenizer_drafts_locally_and_commits_nothing(
    served: tuple[Replica, str], caplog: pytest.LogCaptureFixture
) -> None:
    replica, url = served
    config = ClientConfig(target=replica.target, namespace=NS, vocab_size=VOCAB, tokenizer=THEIRS, deadline_s=0.5)
    caplog.set_level(logging.INFO, logger="decoder_client")
    client, drafts = ended_requests(config, PROMPT, ANSWER, 3)
    assert all(d[:3] == [23, 42, 8] for d in drafts)  # prompt lookup's, drafted here
    assert RedisStore(connect(url)).read_log(NS) == []
    assert client.stats.remote == 0 and client.stats.fallback == 3 and client.stats.commits_dropped == 3
    assert [r for r in caplog.records if "refuses namespace" in r.getMessage() and THEIRS in r.getMessage()]
    with pytest.raises(ValueError, match="fingerprint"):
        ClientConfig(target=replica.target, namespace=NS, tokenizer="ABC")

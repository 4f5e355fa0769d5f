"""Reading the lifetime log over gRPC (ReadLog), what a decoder's near copy follows: from its end
or its start, in pages, every boundary checked before storage is asked; and near copies of two
decoders on one service, each drafting from what the other finished. A real service on a real
Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from cache_service.domain.service import MAX_LOG_READ_TOKENS
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from decoder_client.client.config import ClientConfig
from decoder_client.client.near import NearClient
from indexer.drafter import DraftParams
from tests.service.authed_replicas import md, tenants_replica
from tests.service.conftest import Replica, Running, eventually, replica_with_namespace

NS = "toy"
VOCAB = 100


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[Replica]:
    with replica_with_namespace(tmp_path, NS, VOCAB) as (r, _):
        yield r


def commit(r: Replica, prompt: list[int], output: list[int]) -> None:
    """One request committed, and in the log: a commit that finds another write under way is
    journaled (durable) and written after it, so the log may not hold it yet when acknowledged."""
    (sid,) = r.stub.OpenSessions(
        pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=NS, prompt=prompt)])
    ).session_ids
    r.stub.CloseSessions(
        pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True, new_tokens=output)])
    )
    eventually(lambda: r.admin.Stats(pb.StatsRequest()).storage.journaled_commits == 0)


def read(r: Replica, after: str, max_tokens: int, ns: str = NS) -> pb.ReadLogResponse:
    return r.stub.ReadLog(pb.ReadLogRequest(namespace=ns, after=after, max_tokens=max_tokens))


def test_the_log_is_read_from_its_end_or_its_start_in_pages(replica: Replica) -> None:
    empty = read(replica, "", 100)
    assert list(empty.entries) == [] and empty.last == "0-0"
    requests = [list(range(10 * i, 10 * i + 10)) for i in range(1, 4)]
    for tokens in requests:
        commit(replica, tokens[:4], tokens[4:])
    whole = read(replica, "0", 1000)
    assert [list(e.tokens) for e in whole.entries] == requests
    assert whole.last == whole.entries[-1].id
    # Pages of at most 15 tokens: one 10-token request each, in order.
    first = read(replica, "0", 15)
    assert [list(e.tokens) for e in first.entries] == requests[:1]
    second = read(replica, first.last, 15)
    assert [list(e.tokens) for e in second.entries] == requests[1:2]
    assert len(read(replica, "0", 1).entries) == 1  # a request larger than the page still comes
    assert [list(e.tokens) for e in read(replica, empty.last, 1000).entries] == requests
    # From the end now: nothing yet, and the id to follow from.
    now = read(replica, "", 1000)
    assert list(now.entries) == [] and now.last == whole.last
    commit(replica, [90, 91, 92], [93, 94])
    assert [list(e.tokens) for e in read(replica, now.last, 1000).entries] == [[90, 91, 92, 93, 94]]


@pytest.mark.parametrize(
    ("ns", "after", "max_tokens", "code"),
    [
        (NS, "0", 0, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, "0", MAX_LOG_READ_TOKENS + 1, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, "1-x", 10, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, "$", 10, grpc.StatusCode.INVALID_ARGUMENT),
        # Ids Redis itself would refuse: non-ASCII digits, parts above 2**64 - 1.
        (NS, "\u0663", 10, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, "\u0661-\u0662", 10, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, "18446744073709551616", 10, grpc.StatusCode.INVALID_ARGUMENT),
        (NS, "1-18446744073709551616", 10, grpc.StatusCode.INVALID_ARGUMENT),
        ("", "0", 10, grpc.StatusCode.INVALID_ARGUMENT),
        ("unknown", "0", 10, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_a_bad_read_is_refused(replica: Replica, ns: str, after: str, max_tokens: int, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as err:
        read(replica, after, max_tokens, ns)
    assert err.value.code() is code


def test_nothing_follows_the_largest_log_id(replica: Replica) -> None:
    commit(replica, [1, 2, 3], [4, 5])
    largest = f"{2**64 - 1}-{2**64 - 1}"
    # Redis refuses an exclusive range from the largest id; nothing can come after it anyway.
    after = read(replica, largest, 100)
    assert list(after.entries) == [] and after.last == largest
    assert len(read(replica, f"{2**64 - 1}", 100).entries) == 0


def test_a_service_without_storage_has_no_log_to_read(running: Running) -> None:
    stub = running.stub
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name=NS, vocab_size=VOCAB))
    with pytest.raises(grpc.RpcError) as err:
        stub.ReadLog(pb.ReadLogRequest(namespace=NS, after="0", max_tokens=10))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_a_tenant_reads_only_its_own_namespaces(tmp_path: Path) -> None:
    with tenants_replica(tmp_path, VOCAB) as replica:
        ok = replica.stub.ReadLog(pb.ReadLogRequest(namespace="ns-a", after="0", max_tokens=10), metadata=md("tok-a"))
        assert list(ok.entries) == []
        with pytest.raises(grpc.RpcError) as err:
            replica.stub.ReadLog(pb.ReadLogRequest(namespace="ns-b", after="0", max_tokens=10), metadata=md("tok-a"))
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            replica.stub.ReadLog(pb.ReadLogRequest(namespace="ns-a", after="0", max_tokens=10))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


ANSWER = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]


def test_near_copies_draft_from_what_the_other_decoders_finished(replica: Replica) -> None:
    config = ClientConfig(target=replica.target, namespace=NS, params=DraftParams(chain=8))
    one, two = (NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0.05) for _ in range(2))
    try:
        # Both follow from the log's end once their first read lands.
        eventually(lambda: one._follower is not None and one._follower._after != "")
        eventually(lambda: two._follower is not None and two._follower._after != "")
        (s,) = one.open([[1, 2, 3]])
        one.add_tokens([s], [ANSWER])
        one.close([s])
        eventually(lambda: one.stats.commits_pending == 0 and len(read(replica, "0", 1000).entries) == 1)

        def two_drafts_the_answer() -> bool:
            two.settle()  # an idle decoder takes what was read, as the engine adapters call it
            (t,) = two.open([[7, 8, 1, 2, 3, 40, 41]])
            tokens = two.draft([t], [[]])[0].tokens.tolist()
            two.close([t], commit=False)
            return tokens[:4] == ANSWER[2:6]

        eventually(two_drafts_the_answer)
        assert two.stats.followed == 1
        # The first decoder's own commit was told apart in the log: not added to it twice.
        eventually(lambda: one._follower is not None and one._follower.own == 1)
        one.settle()
        assert one.stats.followed == 0
    finally:
        one.shutdown()
        two.shutdown()


def test_a_near_copy_starts_with_what_the_fleet_finished_before_it(replica: Replica) -> None:
    commit(replica, [1, 2, 3], ANSWER)
    config = ClientConfig(target=replica.target, namespace=NS, params=DraftParams(chain=8))
    late = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0.05)
    empty = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0.05, start_s=0)
    try:
        # Indexed before its first request: the first draft knows the answer, no settle needed.
        (s,) = late.open([[7, 8, 1, 2, 3, 40, 41]])
        assert late.draft([s], [[]])[0].tokens.tolist()[:4] == ANSWER[2:6]
        assert late.stats.followed == 1
        # Following goes on after what it read: a later commit arrives once, the first not again.
        commit(replica, [9, 9, 9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77])
        eventually(lambda: late._follower is not None and late._follower.followed == 1)
        late.settle()
        assert late.stats.followed == 2
        # Started empty, a near copy follows from the log's end: the answer is not in it.
        (t,) = empty.open([[7, 8, 1, 2, 3, 40, 41]])
        assert empty.draft([t], [[]])[0].tokens.tolist()[:4] != ANSWER[2:6]
    finally:
        late.shutdown()
        empty.shutdown()


def test_a_near_copy_leaves_out_log_entries_outside_the_vocabulary(replica: Replica) -> None:
    """A log entry with ids outside the namespace's vocabulary (written past the service, by a
    tool of another tokenizer) never reaches a near copy's memory, at start or when followed."""
    store = RedisStore(connect(replica.app.url))
    store.append_requests(NS, [np.array([1, 2, 3, 40, 41, 142, 143, 144], np.int32)])
    commit(replica, [1, 2, 3], ANSWER)
    config = ClientConfig(target=replica.target, namespace=NS, params=DraftParams(chain=8))
    near = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0.05)
    try:
        assert near.stats.followed == 1  # the good one only
        store.append_requests(NS, [np.array([9, 9, 240, 241], np.int32)])
        commit(replica, [9, 9, 9], [60, 61, 62, 63])
        eventually(lambda: near._follower is not None and near._follower.followed >= 2)
        near.settle()
        assert near.stats.followed == 2
        (s,) = near.open([[7, 8, 1, 2, 3, 40, 41]])
        assert all(t < VOCAB for t in near.draft([s], [[]])[0].tokens.tolist())
    finally:
        near.shutdown()


def test_a_near_copy_whose_service_is_down_starts_empty_at_once(tmp_path: Path) -> None:
    config = ClientConfig(target="127.0.0.1:1", namespace=NS, params=DraftParams(chain=8), control_timeout_s=1.0)
    started = time.monotonic()
    near = NearClient(config, VOCAB, memory_tokens=1 << 16, follow_s=0.05, start_s=5.0)
    try:
        assert time.monotonic() - started < 3.0 and near.stats.followed == 0
        (s,) = near.open([[5, 6, 7, 8, 5, 6]])
        assert near.draft([s], [[]])[0].tokens.tolist()[:2] == [7, 8]  # its own context still drafts
    finally:
        near.shutdown()

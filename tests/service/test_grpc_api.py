"""The gRPC API on a real server bound to a free port: behaviour and status codes."""

from __future__ import annotations

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.service.conftest import Running


def _ns(running: Running, name: str = "toy", vocab: int = 100) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name=name, vocab_size=vocab))


def _open(running: Running, prompt: list[int], namespace: str = "toy") -> str:
    req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=namespace, prompt=prompt)])
    return running.stub.OpenSessions(req).session_ids[0]


def _draft(running: Running, sid: str, new: list[int]) -> pb.Tree:
    return running.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=new)])).trees[0]


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_health_serving(running: Running) -> None:
    stub = health_pb2_grpc.HealthStub(running.channel)
    resp = stub.Check(health_pb2.HealthCheckRequest(service="draftcache.v1.DraftCache"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_draft_from_own_context_then_lifetime(running: Running) -> None:
    _ns(running)
    sid = _open(running, [5, 6, 7, 8, 9, 5, 6])
    tree = _draft(running, sid, [])
    # "5 6" occurred before, followed by "7 8 9": the tree starts with that chain.
    assert list(tree.tokens[:3]) == [7, 8, 9]
    assert list(tree.parents[:3]) == [-1, 0, 1]
    assert len(tree.sources) == len(tree.tokens) == len(tree.scores)
    running.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)]))
    # A new request ending with "8 9" is drafted from the committed request: "5 6" follows.
    other = _open(running, [1, 2, 8, 9])
    assert list(_draft(running, other, []).tokens[:2]) == [5, 6]


def test_batched_draft_keeps_order(running: Running) -> None:
    _ns(running)
    a, b = _open(running, [1, 2, 3, 1, 2]), _open(running, [4, 5, 6, 4, 5])
    req = pb.DraftRequest(items=[pb.DraftItem(session_id=b), pb.DraftItem(session_id=a)])
    trees = running.stub.Draft(req).trees
    # One tree per item, in request order: b continues with 6, a with 3.
    assert trees[0].tokens[0] == 6 and trees[1].tokens[0] == 3


def test_stream_answers_in_order(running: Running) -> None:
    _ns(running)
    sid = _open(running, [1, 2, 3, 1, 2])

    def requests():  # type: ignore[no-untyped-def]
        yield pb.StreamRequest(request_id=7, draft=pb.DraftRequest(items=[pb.DraftItem(session_id=sid)]))
        yield pb.StreamRequest(
            request_id=8, draft=pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[3])])
        )

    out = list(running.stub.Stream(requests()))
    assert [r.request_id for r in out] == [7, 8]
    assert out[0].draft.trees[0].tokens[0] == 3


def test_a_failed_request_on_the_stream_is_answered_with_its_status_and_the_stream_goes_on(
    running: Running,
) -> None:
    _ns(running)
    sid = _open(running, [1, 2, 3, 1, 2])

    def requests():  # type: ignore[no-untyped-def]
        yield pb.StreamRequest(request_id=1, draft=pb.DraftRequest(items=[pb.DraftItem(session_id="nope")]))
        yield pb.StreamRequest(request_id=2)  # no body
        bad = pb.DraftItem(session_id=sid, new_tokens=[10**6])  # outside the vocabulary
        yield pb.StreamRequest(request_id=3, draft=pb.DraftRequest(items=[bad]))
        yield pb.StreamRequest(request_id=4, draft=pb.DraftRequest(items=[pb.DraftItem(session_id=sid)]))

    out = list(running.stub.Stream(requests()))
    assert [r.request_id for r in out] == [1, 2, 3, 4]
    assert [r.WhichOneof("body") for r in out] == ["error", "error", "error", "draft"]
    codes = [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT]
    assert [r.error.code for r in out[:3]] == [c.value[0] for c in codes]
    assert "nope" in out[0].error.message
    # The refused step changed nothing: the session still continues "1 2" with 3.
    assert out[3].draft.trees[0].tokens[0] == 3


def test_echo(running: Running) -> None:
    assert running.stub.Echo(pb.EchoRequest(payload=b"x" * 100)).payload == b"x" * 100


def test_unknown_session_is_not_found(running: Running) -> None:
    _ns(running)
    assert _code(lambda: _draft(running, "no-such-session", [])) == grpc.StatusCode.NOT_FOUND


def test_closed_session_is_not_found(running: Running) -> None:
    _ns(running)
    sid = _open(running, [1, 2])
    running.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid)]))
    assert _code(lambda: _draft(running, sid, [])) == grpc.StatusCode.NOT_FOUND


def test_unknown_namespace_is_not_found(running: Running) -> None:
    assert _code(lambda: _open(running, [1], namespace="nope")) == grpc.StatusCode.NOT_FOUND


def test_out_of_vocabulary_is_invalid_and_changes_nothing(running: Running) -> None:
    _ns(running, vocab=10)
    assert _code(lambda: _open(running, [1, 10])) == grpc.StatusCode.INVALID_ARGUMENT
    sid = _open(running, [1, 2, 3, 1, 2])
    before = _draft(running, sid, [])
    # A batch whose second item is bad is rejected whole: the first session is not advanced.
    bad = pb.DraftRequest(
        items=[pb.DraftItem(session_id=sid, new_tokens=[3]), pb.DraftItem(session_id=sid, new_tokens=[-1])]
    )
    assert _code(lambda: running.stub.Draft(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    assert list(_draft(running, sid, []).tokens) == list(before.tokens)


def test_oversized_batch_and_step_are_resource_exhausted(running: Running) -> None:
    _ns(running)
    sid = _open(running, [1])
    big = pb.DraftRequest(items=[pb.DraftItem(session_id=sid)] * 9)  # max_batch is 8
    assert _code(lambda: running.stub.Draft(big)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _code(lambda: _draft(running, sid, [1] * 65)) == grpc.StatusCode.RESOURCE_EXHAUSTED  # max_new_tokens 64


def _columns(
    sids: list[str], counts: list[int], tokens: list[int], lookahead: list[int] | None = None
) -> pb.DraftRequest:
    return pb.DraftRequest(
        columns=pb.DraftColumns(session_ids=sids, new_token_counts=counts, new_tokens=tokens, lookahead=lookahead or [])
    )


def test_a_columnar_batch_drafts_what_items_draft(running: Running) -> None:
    _ns(running)
    prompts = ([1, 2, 3, 1, 2], [5, 6, 7, 5], [9, 8, 9, 8, 9])
    by_items, by_columns = [_open(running, list(p)) for p in prompts], [_open(running, list(p)) for p in prompts]
    steps = ([3], [], [8]), ([1, 2], [6], [9, 8])
    for news in steps:
        items = pb.DraftRequest(
            items=[pb.DraftItem(session_id=s, new_tokens=n) for s, n in zip(by_items, news, strict=True)]
        )
        flat = [t for n in news for t in n]
        columns = _columns(by_columns, [len(n) for n in news], flat)
        want, got = running.stub.Draft(items).trees, running.stub.Draft(columns).trees
        assert [list(t.tokens) for t in got] == [list(t.tokens) for t in want]
        assert [list(t.parents) for t in got] == [list(t.parents) for t in want]
    assert any(len(t.tokens) for t in got)
    ahead = running.stub.Draft(_columns(by_columns, [1, 0, 0], [3], [2, 0, 1]))
    assert len(ahead.trees) == 3 and len(ahead.prefetched) == 3


def test_a_bad_columnar_batch_gets_its_status_and_changes_nothing(running: Running) -> None:
    _ns(running, vocab=10)
    a, b = _open(running, [1, 2, 3, 1, 2]), _open(running, [4, 5, 4])
    before = [list(_draft(running, s, []).tokens) for s in (a, b)]
    invalid = [
        _columns([a, b], [1], [3]),  # a count per session
        _columns([a, b], [1, 1], [3]),  # counts add up to the tokens sent
        _columns([a, b], [1, 1], [3, 10]),  # b's token is outside the vocabulary
        _columns([a, b], [1, 1], [3, -1]),
        _columns([a, b], [1, 1], [3, 4], [1]),  # a lookahead per session, or none
        _columns([a, b], [1, 1], [3, 4], [0, 17]),  # lookahead at most 16
        _columns([], [], [3]),
        pb.DraftRequest(
            items=[pb.DraftItem(session_id=a)], columns=pb.DraftColumns(session_ids=[b], new_token_counts=[0])
        ),
    ]
    for req in invalid:
        assert _code(lambda req=req: running.stub.Draft(req)) == grpc.StatusCode.INVALID_ARGUMENT, req
    with pytest.raises(grpc.RpcError) as err:
        running.stub.Draft(_columns([a, b], [1, 2], [3, 4, 10]))
    assert "position 1" in (err.value.details() or "")  # where in b's tokens
    assert _code(lambda: running.stub.Draft(_columns([a, "no-such-session"], [1, 0], [3]))) == grpc.StatusCode.NOT_FOUND
    exhausted = [_columns([a] * 9, [0] * 9, []), _columns([a, b], [65, 0], [1] * 65)]  # max_batch 8, max_new_tokens 64
    for req in exhausted:
        assert _code(lambda req=req: running.stub.Draft(req)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [list(_draft(running, s, []).tokens) for s in (a, b)] == before  # neither session was advanced


def test_bad_budget_is_invalid(running: Running) -> None:
    _ns(running)
    req = pb.OpenSessionsRequest(
        sessions=[pb.OpenSession(namespace="toy", prompt=[1], params=pb.DraftParams(budget=5000))]
    )
    assert _code(lambda: running.stub.OpenSessions(req)) == grpc.StatusCode.INVALID_ARGUMENT


def test_namespace_conflict_is_already_exists(running: Running) -> None:
    _ns(running, vocab=100)
    assert _code(lambda: _ns(running, vocab=50)) == grpc.StatusCode.ALREADY_EXISTS


def test_admin_stats_and_rebuild(running: Running) -> None:
    _ns(running)
    sid = _open(running, [1, 2, 3])
    running.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)]))
    (info,) = running.admin.Rebuild(pb.RebuildRequest(namespace="toy")).namespaces
    # 3 tokens plus the request separator were buffered and indexed.
    assert info.buffered_tokens == 4 and info.index_tokens == 4 and info.requests == 1
    stats = running.admin.Stats(pb.StatsRequest())
    assert stats.sessions == 0 and [n.name for n in stats.namespaces] == ["toy"]


def test_session_memory_is_bounded_by_evicting_the_least_recently_used() -> None:
    from cache_service.config import ServiceConfig
    from tests.service.conftest import start_service, stop_service

    running = start_service(ServiceConfig(max_session_tokens=100))
    try:
        _ns(running)
        first = _open(running, [1] * 40)
        second = _open(running, [2] * 40)
        _draft(running, first, [3])  # first is now the more recently used (41 tokens)
        third = _open(running, [4] * 30)  # 41 + 40 + 30 > 100: the least recently used leaves
        assert running.service.sessions.tokens <= 100 and running.service.sessions.evicted == 1
        assert _code(lambda: _draft(running, second, [])) == grpc.StatusCode.NOT_FOUND
        assert _draft(running, first, []) is not None and _draft(running, third, []) is not None
        # A prompt larger than all session memory is refused outright.
        assert _code(lambda: _open(running, [5] * 101)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Closing frees its tokens.
        running.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=first)]))
        assert running.service.sessions.tokens == 30
    finally:
        stop_service(running)


def test_an_open_past_the_session_limit_is_refused_whole() -> None:
    from cache_service.config import ServiceConfig
    from tests.service.conftest import start_service, stop_service

    running = start_service(ServiceConfig(max_sessions=6))
    try:
        _ns(running)
        for _ in range(4):
            _open(running, [1, 2])

        def batch(n: int) -> pb.OpenSessionsRequest:
            return pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[1, 2, 3])] * n)

        # 4 held + 3 > 6: refused, and none of the three is held (the client never saw an id).
        assert _code(lambda: running.stub.OpenSessions(batch(3))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert running.admin.Stats(pb.StatsRequest()).sessions == 4
        # The room the refused call did not take is there for a batch that fits.
        assert len(running.stub.OpenSessions(batch(2)).session_ids) == 2
        assert running.admin.Stats(pb.StatsRequest()).sessions == 6
    finally:
        stop_service(running)


def _feedback(sid: str, accepted: list[int], branches: list[list[int]], items: int = 1) -> pb.FeedbackRequest:
    rejected = [pb.RejectedBranch(offset=0, tokens=b) for b in branches]
    return pb.FeedbackRequest(items=[pb.FeedbackItem(session_id=sid, accepted=accepted, rejected=rejected)] * items)


def test_rejected_branches_past_the_limits_are_refused_and_change_nothing() -> None:
    from cache_service.config import ServiceConfig
    from cache_service.domain.admission import MAX_BRANCH_TOKENS, MAX_CALL_BRANCHES, MAX_ITEM_BRANCHES
    from tests.service.conftest import start_service, stop_service

    running = start_service(ServiceConfig())  # a batch of 256: enough items to pass the call's limit
    try:
        _ns(running)
        sid, control = _open(running, [1, 2, 3, 1, 2]), _open(running, [1, 2, 3, 1, 2])
        oversized = [
            _feedback(sid, [3], [[4]] * (MAX_ITEM_BRANCHES + 1)),  # more than any tree's nodes
            _feedback(sid, [3], [[4] * (MAX_BRANCH_TOKENS + 1)]),  # longer than any tree's paths
            _feedback(sid, [3], [[4]] * MAX_ITEM_BRANCHES, items=MAX_CALL_BRANCHES // MAX_ITEM_BRANCHES + 1),
        ]
        for req in oversized:
            assert _code(lambda req=req: running.stub.Feedback(req)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The largest a tree can report is taken, and every refused call left the session as it was.
        for s in (sid, control):
            running.stub.Feedback(_feedback(s, [3], [[5, 6]] * (MAX_ITEM_BRANCHES - 1) + [[7] * MAX_BRANCH_TOKENS]))
        assert list(_draft(running, sid, [1, 2]).tokens) == list(_draft(running, control, [1, 2]).tokens)
        assert running.service.sessions.get(sid).session.context.tokens.tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    finally:
        stop_service(running)

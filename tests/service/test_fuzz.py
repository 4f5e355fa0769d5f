"""Fuzzing the gRPC API of a real server: generated and mutated requests get a clear status
code, never crash it, and a rejected request leaves no trace (a later replay drafts exactly as
on a server that never saw it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.remote import RemoteDrafter
from benchmarks.replay import replay
from benchmarks.traces import read_traces
from cache_service.config import ServiceConfig
from indexer.drafter import DraftParams
from tests.service.conftest import Running, start_service, stop_service

VOCAB = 32000
CONFIG = ServiceConfig(max_batch=8, max_new_tokens=64, max_prompt_tokens=4096)
# Answers a bad request may get; anything else (INTERNAL, UNKNOWN, a hang) is a bug.
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
BAD_ID = "00000000000000000000000000000000"


def _pool(running: Running, n: int = 4) -> list[str]:
    """Sessions in the replayed namespace, only ever named in batches that must fail."""
    req = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="llama2", prompt=[1, 2, 3, 1, 2])] * n)
    return list(running.stub.OpenSessions(req).session_ids)


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[tuple[Running, list[str]]]:
    running = start_service(CONFIG)
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="llama2", vocab_size=VOCAB))
    yield running, _pool(running)
    stop_service(running)


ids = st.integers(-(2**31), 2**31 - 1)
bad_token = st.sampled_from([-1, -(2**31), VOCAB, VOCAB + 1, 2**31 - 1])
good_tokens = st.lists(st.integers(0, VOCAB - 1), max_size=8)


@st.composite
def poisoned_tokens(draw: st.DrawFn) -> list[int]:
    """A token list with at least one id outside the vocabulary."""
    tokens = draw(good_tokens)
    tokens.insert(draw(st.integers(0, len(tokens))), draw(bad_token))
    return tokens


params = st.builds(
    pb.DraftParams,
    budget=st.integers(0, 5000),
    max_depth=st.integers(0, 500),
    min_score=st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.just(0.0)),
    depth_reserve=st.integers(0, 500),
)


@st.composite
def bad_draft(draw: st.DrawFn, pool: list[str]) -> pb.DraftRequest:
    """A batch mixing good items with at least one that must be refused."""
    good = [pb.DraftItem(session_id=s, new_tokens=draw(good_tokens)) for s in draw(st.lists(st.sampled_from(pool)))]
    poison = draw(
        st.one_of(
            st.builds(lambda t: pb.DraftItem(session_id=pool[0], new_tokens=t), poisoned_tokens()),
            st.builds(lambda s: pb.DraftItem(session_id=s), st.sampled_from([BAD_ID, "", "x" * 300, "\x00"])),
            st.builds(lambda k: pb.DraftItem(session_id=pool[0], lookahead=k), st.integers(17, 2**32 - 1)),
            st.builds(
                lambda n: pb.DraftItem(session_id=pool[0], new_tokens=[1] * n),
                st.integers(CONFIG.max_new_tokens + 1, 3000),
            ),
        )
    )
    items = [*good, poison]
    items = draw(st.permutations(items))
    if draw(st.booleans()):
        items = items + [pb.DraftItem(session_id=pool[0])] * (CONFIG.max_batch + 1 - len(items))
    if not draw(st.booleans()):
        return pb.DraftRequest(items=items)
    # The same batch in columns; or columns that do not fit together.
    counts = [len(i.new_tokens) for i in items]
    lookahead = [i.lookahead for i in items]
    misfit = draw(st.sampled_from(["none", "counts", "lookahead"]))
    if misfit == "counts":
        counts[draw(st.integers(0, len(counts) - 1))] += draw(st.integers(1, 5))
    elif misfit == "lookahead":
        lookahead = lookahead + [0] * draw(st.integers(1, 3))
    columns = pb.DraftColumns(
        session_ids=[i.session_id for i in items],
        new_token_counts=counts,
        new_tokens=[t for i in items for t in i.new_tokens],
        lookahead=lookahead,
    )
    return pb.DraftRequest(columns=columns)


@st.composite
def bad_feedback(draw: st.DrawFn, pool: list[str]) -> pb.FeedbackRequest:
    sid = draw(st.sampled_from([*pool, BAD_ID]))
    accepted = draw(st.one_of(good_tokens, poisoned_tokens()))
    offset = draw(st.integers(0, 2**32 - 1))
    branch = pb.RejectedBranch(offset=offset, tokens=draw(st.one_of(good_tokens, poisoned_tokens())))
    item = pb.FeedbackItem(session_id=sid, accepted=accepted, rejected=[branch])
    # Valid only by accident; then make it certainly invalid with an unknown session beside it.
    return pb.FeedbackRequest(items=[item, pb.FeedbackItem(session_id=BAD_ID, accepted=[1])])


@st.composite
def bad_open(draw: st.DrawFn) -> pb.OpenSessionsRequest:
    ns = draw(st.sampled_from(["llama2", "nope", "", "x" * 1000]))
    prompt = draw(poisoned_tokens()) if ns == "llama2" else draw(good_tokens)
    session = pb.OpenSession(namespace=ns, prompt=prompt, params=draw(params))
    return pb.OpenSessionsRequest(sessions=[session])


@st.composite
def bad_close(draw: st.DrawFn, pool: list[str]) -> pb.CloseSessionsRequest:
    items = [  # each with a last step's tokens, good or bad: none may join a context
        pb.CloseSession(
            session_id=s,
            commit=True,
            commit_from=draw(st.sampled_from([0, 2**31])),
            new_tokens=draw(st.one_of(good_tokens, poisoned_tokens())),
        )
        for s in draw(st.lists(st.sampled_from(pool), max_size=3))
    ]
    items.append(pb.CloseSession(session_id=draw(st.sampled_from([BAD_ID, "", "\x00\x01"])), commit=True))
    return pb.CloseSessionsRequest(sessions=draw(st.permutations(items)))


def _refused(call, request) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    code = err.value.code()
    assert code in CLEAR, f"{code}: {err.value.details()}"
    assert err.value.details()  # a message saying what was wrong
    return code


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_requests_get_clear_codes(fuzzed, data) -> None:  # type: ignore[no-untyped-def]
    running, pool = fuzzed
    stub = running.stub
    kind = data.draw(st.sampled_from(["draft", "feedback", "open", "close"]))
    if kind == "draft":
        _refused(stub.Draft, data.draw(bad_draft(pool)))
    elif kind == "feedback":
        _refused(stub.Feedback, data.draw(bad_feedback(pool)))
    elif kind == "open":
        _refused(stub.OpenSessions, data.draw(bad_open()))
    else:
        _refused(stub.CloseSessions, data.draw(bad_close(pool)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=200), method=st.sampled_from(["Draft", "OpenSessions", "Feedback", "CloseSessions"]))
def test_mutated_bytes_never_crash_the_server(fuzzed, blob, method) -> None:  # type: ignore[no-untyped-def]
    running, _ = fuzzed
    call = running.channel.unary_unary(f"/draftcache.v1.DraftCache/{method}")
    try:
        call(blob, timeout=30)
    except grpc.RpcError as exc:
        # Undecodable bytes or a decodable but bad request: a clear refusal either way.
        assert exc.code() in CLEAR, f"{exc.code()}: {exc.details()}"


def test_a_huge_message_is_refused_and_the_server_lives(fuzzed) -> None:  # type: ignore[no-untyped-def]
    running, pool = fuzzed
    huge = pb.DraftRequest(items=[pb.DraftItem(session_id=pool[0], new_tokens=[1] * 200_000)])
    assert _refused(running.stub.Draft, huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert running.stub.Echo(pb.EchoRequest(payload=b"ok"), timeout=5).payload == b"ok"


def test_refused_requests_leave_no_trace(fuzzed, shared_data: Path) -> None:  # type: ignore[no-untyped-def]
    # Runs after the fuzzing above (same module server): the replayed namespace drafts exactly
    # as on a fresh server that opened the same idle sessions and never saw a bad request.
    running, _ = fuzzed
    convs = read_traces(shared_data / "traces" / "spec_bench_vicuna7b.jsonl.gz", limit=8)
    after_fuzz = replay(convs, RemoteDrafter(running.target, "llama2", DraftParams()))
    fresh = start_service(CONFIG)
    try:
        fresh.admin.CreateNamespace(pb.CreateNamespaceRequest(name="llama2", vocab_size=VOCAB))
        _pool(fresh)
        clean = replay(convs, RemoteDrafter(fresh.target, "llama2", DraftParams()))
    finally:
        stop_service(fresh)
    assert (after_fuzz.steps, after_fuzz.drafted, after_fuzz.mat) == (clean.steps, clean.drafted, clean.mat)

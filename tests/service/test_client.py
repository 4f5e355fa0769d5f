"""DraftClient against a real server: remote drafts, deadline-bounded fallback when the service
is slow or gone, and re-opened sessions when it returns."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from cache_service.config import ServiceConfig
from cache_service.host.embedded_redis import free_port
from decoder_client.client import ClientConfig, ClientStats, DraftClient
from indexer.drafter import DraftParams
from tests.service.conftest import eventually, start_service, stop_service

# A "document" the target copies around new tokens: prompt lookup and the service both draft
# the copies; the new tokens take one step each, whoever drafts.
TEXT = [5, 17, 23, 42, 8, 15, 16, 4, 99, 7, 31, 64, 2, 11, 13, 21]
PROMPT = [*TEXT, 1, 2, 3]
TARGET = np.array([*TEXT, 77, 78, 79, 80, 81, 82, *TEXT], dtype=np.int32)


def _generate(client: DraftClient, on_step=None) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    """Greedy-exact generation of TARGET after PROMPT, drafting through the client."""
    (session,) = client.open([PROMPT])
    out: list[int] = []
    new: list[int] = []
    steps = 0
    while len(out) < TARGET.size:
        if on_step is not None:
            on_step(steps)
        (tree,) = client.draft([session], [new])
        accepted = len(tree.accept(TARGET[len(out) :]))
        new = TARGET[len(out) : len(out) + accepted + 1].tolist()
        out.extend(new)
        steps += 1
    client.close([session])
    return out, steps


def _ns(target: str) -> None:
    with grpc.insecure_channel(target) as ch:
        request = pb.CreateNamespaceRequest(name="toy", vocab_size=128)
        pb_grpc.AdminStub(ch).CreateNamespace(request, wait_for_ready=True, timeout=10)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_remote_drafts_and_fallback_when_the_service_stops(stream: bool) -> None:
    port = free_port()
    running = start_service(ServiceConfig(), port=port)
    _ns(running.target)
    config = ClientConfig(target=running.target, namespace="toy", deadline_s=0.05, retry_after_s=0.2, stream=stream)
    client = DraftClient(config)
    stopped = {}

    def stop_midway(step: int) -> None:
        if step == 1 and not stopped:
            stop_service(running)
            stopped["at"] = step

    out, steps = _generate(client, stop_midway)
    # Generation completes with exactly the target tokens, in fewer steps than tokens.
    assert out == TARGET.tolist() and steps < TARGET.size
    assert client.stats.remote >= 1 and client.stats.fallback >= 1 and client.stats.failures >= 1

    # The service comes back on the same address: the client re-opens with the full context.
    running = start_service(ServiceConfig(), port=port)
    _ns(running.target)
    (session,) = client.open([PROMPT])
    deadline = time.monotonic() + 10
    remote_before = client.stats.remote
    while client.stats.remote == remote_before:  # falls back until the channel reconnects
        assert time.monotonic() < deadline, "the client never went back to the service"
        client.draft([session], [[]])
        time.sleep(0.05)
    assert client.stats.remote == remote_before + 1
    # The request that ended while the service was down is committed now that it answers.
    while running.service.stats("toy")[0].requests == 0:
        assert time.monotonic() < deadline, "the request that ended during the outage was never committed"
        client.draft([session], [[]])
        time.sleep(0.05)
    (ns,) = running.service.stats("toy")
    assert ns.requests == 1 and len(PROMPT) + 1 < ns.buffered_tokens <= len(PROMPT) + TARGET.size + 1
    client.shutdown()
    assert client.stats.commits_retried == 1 and client._core.commits.unsent == 0
    stop_service(running)


class _SlowServicer(pb_grpc.DraftCacheServicer):
    """Answers every draft after ``delays`` (one per call, the last one repeated), with a
    one-node tree naming the stream request it answers; stream requests whose id is in
    ``fail`` are answered with NOT_FOUND instead. Counts opens."""

    def __init__(self, delays: list[float], fail: set[int] | None = None) -> None:
        self.delays = delays
        self.fail = fail if fail is not None else set()
        self.opens = 0

    async def OpenSessions(self, request, context):  # type: ignore[no-untyped-def]
        self.opens += 1
        return pb.OpenSessionsResponse(session_ids=[f"s{self.opens}"] * len(request.sessions))

    async def CloseSessions(self, request, context):  # type: ignore[no-untyped-def]
        return pb.CloseSessionsResponse()

    async def Draft(self, request, context, request_id: int = 0):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.delays.pop(0) if len(self.delays) > 1 else self.delays[0])
        n = len(request.items) or len(request.columns.session_ids)
        return pb.DraftResponse(trees=[pb.Tree(tokens=[request_id], parents=[-1]) for _ in range(n)])

    async def Stream(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for req in request_iterator:
            kind = req.WhichOneof("body")
            if kind == "draft":
                reply = await self.Draft(req.draft, context, req.request_id)
                if req.request_id in self.fail:
                    error = pb.StreamError(code=grpc.StatusCode.NOT_FOUND.value[0], message="gone")
                    yield pb.StreamResponse(request_id=req.request_id, error=error)
                    continue
            else:
                reply = await getattr(self, {"open": "OpenSessions", "close": "CloseSessions"}[kind])(
                    getattr(req, kind), context
                )
            yield pb.StreamResponse(request_id=req.request_id, **{kind: reply})


@contextlib.contextmanager
def _slow_server(delays: list[float], fail: set[int] | None = None) -> Iterator[tuple[int, _SlowServicer]]:
    """A server of ``_SlowServicer(delays, fail)`` on its own loop: its port and servicer."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    servicer = _SlowServicer(delays, fail)

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        pb_grpc.add_DraftCacheServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield port, servicer
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


async def _three_drafts_async(config: ClientConfig, pauses: tuple[float, float]) -> tuple[list[int], ClientStats]:
    """With the asyncio client, one session: draft, pause, draft, pause, draft. The last tree's
    tokens and the client's counts."""
    from decoder_client.client import AsyncDraftClient

    client = AsyncDraftClient(config)
    (session,) = await client.open([PROMPT])
    await client.draft([session], [[]])
    await asyncio.sleep(pauses[0])
    await client.draft([session], [[]])
    await asyncio.sleep(pauses[1])
    (tree,) = await client.draft([session], [[]])
    await client.shutdown()
    return tree.tokens.tolist(), client.stats


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_deadline_holds_against_a_slow_service(stream: bool) -> None:
    deadline = 0.01
    with _slow_server([0.2]) as (port, _):  # far past any draft deadline
        config = ClientConfig(
            target=f"127.0.0.1:{port}", namespace="toy", deadline_s=deadline, retry_after_s=0, stream=stream
        )
        client = DraftClient(config)
        (session,) = client.open([PROMPT])
        waits = []
        for _ in range(10):
            t0 = time.perf_counter()
            (tree,) = client.draft([session], [[]])
            waits.append(time.perf_counter() - t0)
            # The local drafter answered: prompt lookup continues "1 2 3" nowhere, but it always answers.
            assert tree is not None
        # Every call returned within the deadline plus scheduling slack, never after the 200 ms reply.
        assert max(waits) < deadline + 0.05
        assert client.stats.fallback == 10 and client.stats.remote == 0
        client.shutdown()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_call_may_wait_longer_than_the_configured_deadline(stream: bool) -> None:
    # An engine scales the deadline to its step: a 50 ms answer misses the configured 5 ms,
    # but lands within a call's own 1 s.
    with _slow_server([0.05]) as (port, _):
        config = ClientConfig(target=f"127.0.0.1:{port}", namespace="toy", deadline_s=0.005, stream=stream)
        client = DraftClient(config)
        (session,) = client.open([PROMPT])
        (tree,) = client.draft([session], [[]], deadline_s=1.0)
        assert client.stats.remote == 1 and client.stats.fallback == 0 and tree.tokens.size == 1
        # The wait on the reply is counted: at least the service's 50 ms.
        assert client.stats.draft_calls == 1 and 0.05 <= client.stats.draft_wait_s < 1.0
        waited = client.stats.draft_wait_s
        t0 = time.perf_counter()
        client.draft([session], [[]])  # the configured deadline: the local drafter answers
        assert time.perf_counter() - t0 < 0.045 and client.stats.fallback == 1
        # A call given up on counts the wait until then, not the late reply.
        assert client.stats.draft_calls == 2 and 0.001 <= client.stats.draft_wait_s - waited < 0.045
        with pytest.raises(ValueError, match="deadline_s"):
            client.draft([session], [[]], deadline_s=0)
        client.shutdown()


def test_a_late_draft_on_the_stream_still_counts_unless_it_fails() -> None:
    # Stream request 1 is answered after 600 ms, past the 250 ms deadline; later ones at once
    # (the deadline leaves a busy machine room to answer those in time).
    # The service applies a late request in order, so the session keeps its server copy: no
    # re-open, and the next tree is the next request's own (the late reply is dropped).
    for fail in (set(), {1}):
        with _slow_server([0.6, 0.0], fail) as (port, servicer):
            config = ClientConfig(target=f"127.0.0.1:{port}", namespace="toy", deadline_s=0.25, retry_after_s=0)
            client = DraftClient(config)
            (session,) = client.open([PROMPT])
            client.draft([session], [[]])  # late: the local drafter answers
            time.sleep(0.5)  # the late reply arrives meanwhile
            (second,) = client.draft([session], [[]])
            time.sleep(0.05)
            (third,) = client.draft([session], [[]])
            client.shutdown()
            if not fail:
                assert client.stats.fallback == 1 and servicer.opens == 1
                assert second.tokens.tolist() == [2] and third.tokens.tolist() == [3]
            else:  # the late request failed: its session is re-opened, drafting locally meanwhile
                assert client.stats.fallback == 2 and servicer.opens == 2
                assert third.tokens.tolist() == [2]

            servicer.delays[:] = [0.6, 0.0]
            opens = servicer.opens
            # A new client: new streams, numbered from 1 again.
            tokens, _ = asyncio.run(_three_drafts_async(config, (0.5, 0.05)))
            assert tokens == ([3] if not fail else [2])
            assert servicer.opens == opens + (1 if not fail else 2)


def test_chain_proposer_over_the_service(running) -> None:  # type: ignore[no-untyped-def]
    from decoder_client.adapters import ChainProposer

    _ns(running.target)
    proposer = ChainProposer(DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0)), 4)
    proposer.start("r1", PROMPT + TEXT[:2])
    # The prompt holds the document; after its first two tokens the chain continues it.
    assert proposer.propose({"r1": []}) == {"r1": TEXT[2:6]}
    proposer.finish("r1")


def test_chain_mode_over_the_wire() -> None:
    """A session opened in chain mode gets chains of at most K tokens from the service, and
    from the fallback once the service is gone."""

    running = start_service(ServiceConfig(), port=free_port())
    _ns(running.target)
    chains = ClientConfig(target=running.target, namespace="toy", deadline_s=1.0, params=DraftParams(chain=3))
    client = DraftClient(chains)
    trees = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0))
    (session, tree_session) = client.open([PROMPT + TEXT[:2]]) + trees.open([PROMPT + TEXT[:2]])
    (chain,) = client.draft([session], [[]])
    (tree,) = trees.draft([tree_session], [[]])
    assert chain.tokens.tolist() == TEXT[2:5] and chain.parents.tolist() == [-1, 0, 1]
    assert len(tree) > 3  # the same context in tree mode: the full continuation
    assert client.stats.fallback == 0
    stop_service(running)
    (chain,) = client.draft([session], [TEXT[2:5]])
    assert client.stats.fallback == 1 and 0 < len(chain) <= 3


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_async_client_drafts_and_falls_back(stream: bool) -> None:
    from decoder_client.client import AsyncDraftClient

    running = start_service(ServiceConfig())
    _ns(running.target)

    async def scenario() -> tuple[list[int], list[int], int, int]:
        config = ClientConfig(target=running.target, namespace="toy", deadline_s=0.5, stream=stream)
        client = AsyncDraftClient(config)
        (session,) = await client.open([PROMPT + TEXT[:2]])
        (remote_tree,) = await client.draft([session], [[]])
        stop_service(running)  # gone: the next call must not wait for it
        t0 = time.perf_counter()
        (local_tree,) = await client.draft([session], [[TEXT[2]]])
        waited = time.perf_counter() - t0
        await client.shutdown()
        assert waited < 0.5 + 0.2
        # Both steps waited on a call: the answered one and the one the stopped service failed.
        assert client.stats.draft_calls == 2 and 0 < client.stats.draft_wait_s <= waited + 0.5
        return (
            remote_tree.tokens[:3].tolist(),
            local_tree.tokens[:3].tolist(),
            client.stats.remote,
            client.stats.fallback,
        )

    remote, local, n_remote, n_fallback = asyncio.run(scenario())
    # The service continued the document; after it stopped, prompt lookup did the same.
    assert remote == TEXT[2:5] and local == TEXT[3:6]
    assert (n_remote, n_fallback) == (1, 1)


def _repeat_target() -> tuple[list[int], np.ndarray]:
    # The document four times over, each copy with a different new token after it: drafts
    # follow the copies and fail on the new token; the bonus is what the cache saw before.
    prompt = [*TEXT, 90, *TEXT, 91]
    target = np.array([*TEXT, 90, *TEXT, 91, *TEXT, 90, *TEXT, 91], dtype=np.int32)
    return prompt, target


@pytest.mark.parametrize("chain", [0, 4], ids=["trees", "chains"])
def test_prespeculation_serves_trees_drafted_ahead_with_the_same_tokens(chain: int) -> None:
    running = start_service(ServiceConfig())
    _ns(running.target)
    prompt, target = _repeat_target()
    results = {}
    try:
        for lookahead in (0, 4):
            client = DraftClient(
                ClientConfig(
                    target=running.target,
                    namespace="toy",
                    deadline_s=1.0,
                    lookahead=lookahead,
                    params=DraftParams(chain=chain),
                )
            )
            (session,) = client.open([prompt])
            out: list[int] = []
            new: list[int] = []
            while len(out) < target.size:
                (tree,) = client.draft([session], [new])
                if chain:  # what a chain-mode call serves, drafted ahead or not
                    assert len(tree) <= chain and tree.parents.tolist() == list(range(-1, len(tree) - 1))
                accepted = len(tree.accept(target[len(out) :]))
                new = target[len(out) : len(out) + accepted + 1].tolist()
                out.extend(new)
            client.close([session], commit=False)
            client.shutdown()
            results[lookahead] = (out, client.stats)
    finally:
        stop_service(running)
    plain, ahead = results[0][1], results[4][1]
    # Same tokens either way; some trees were drafted ahead; nothing fell back.
    assert results[0][0] == results[4][0] == target.tolist()
    assert ahead.ahead_hits > 0 and ahead.fallback == 0 and ahead.failures == 0
    assert plain.ahead_hits == plain.ahead_misses == 0
    # Every step is either a hit or a miss after the first.
    assert ahead.ahead_hits + ahead.ahead_misses == ahead.remote - 1


def test_async_client_prespeculates() -> None:
    from decoder_client.client import AsyncDraftClient

    running = start_service(ServiceConfig())
    _ns(running.target)
    prompt, target = _repeat_target()

    async def scenario() -> tuple[list[int], int]:
        client = AsyncDraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0, lookahead=4))
        (session,) = await client.open([prompt])
        out: list[int] = []
        new: list[int] = []
        while len(out) < target.size:
            (tree,) = await client.draft([session], [new])
            accepted = len(tree.accept(target[len(out) :]))
            new = target[len(out) : len(out) + accepted + 1].tolist()
            out.extend(new)
        await client.close([session], commit=False)
        await client.shutdown()
        return out, client.stats.ahead_hits

    try:
        out, hits = asyncio.run(scenario())
    finally:
        stop_service(running)
    assert out == target.tolist() and hits > 0


def test_a_stream_that_stops_answering_is_replaced() -> None:
    # The first draft's answer would take 10 s: the stream (answered in order) is stuck behind
    # it. Once that call is past the control timeout the client gives the stream up, re-opens
    # the session it was drafting for, and drafts on a new stream.
    with _slow_server([10.0, 0.0]) as (port, servicer):
        config = ClientConfig(
            target=f"127.0.0.1:{port}", namespace="toy", deadline_s=0.05, control_timeout_s=0.3, retry_after_s=0
        )
        client = DraftClient(config)
        (session,) = client.open([PROMPT])
        client.draft([session], [[]])  # late
        stuck = client._streams["draft"]
        time.sleep(0.4)
        client.draft([session], [[]])  # the late call got no answer: the session is re-opened
        time.sleep(0.1)
        (tree,) = client.draft([session], [[]])
        assert client._streams["draft"] is not stuck and stuck.error is not None
        assert tree.tokens.tolist() == [1] and client.stats.remote == 1 and servicer.opens == 2
        client.shutdown()

        servicer.delays[:] = [10.0, 0.0]
        tokens, stats = asyncio.run(_three_drafts_async(config, (0.4, 0.1)))
        assert tokens == [1] and stats.remote == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_missed_deadline_keeps_or_replaces_the_server_copy(running, stream: bool) -> None:  # type: ignore[no-untyped-def]
    _ns(running.target)
    # Drafting takes 30 ms, the deadline is 10 ms: every draft falls back.
    draft_ahead = running.service.draft_ahead

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.03)
        return draft_ahead(*args, **kwargs)

    running.service.draft_ahead = slow
    config = ClientConfig(target=running.target, namespace="toy", deadline_s=0.01, retry_after_s=0, stream=stream)
    client = DraftClient(config)
    (session,) = client.open([PROMPT])
    for token in TEXT[:10]:
        client.draft([session], [[token]])
        time.sleep(0.05)  # the target verifies; meanwhile a late call lands or a re-open runs
    assert client.stats.fallback == 10
    if stream:
        # A late call on the stream still reaches the service in order: the session kept its
        # copy, which holds every token, and nothing was re-opened.
        assert client.stats.reopened == 0
        live = running.service.sessions.get(session.server_id).session
        assert live.context.tokens.tolist() == [*PROMPT, *TEXT[:10]]
    else:
        # A late unary call may or may not have landed: the session is re-opened.
        assert client.stats.reopened >= 3
    # Once the calls in flight land, the server holds the live copy only, not one per miss;
    # copies of opens the client gave up on (a loaded machine can delay one past 1 s) are
    # closed by the ids the client chose for them.
    client.shutdown()
    assert len(running.service.sessions) == 1


def test_a_slow_commit_does_not_hold_up_drafts(running) -> None:  # type: ignore[no-untyped-def]
    from decoder_client.client import AsyncDraftClient

    _ns(running.target)
    commit = running.service._commit

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.5)  # in the service's commit thread: the close's reply waits for it
        return commit(*args, **kwargs)

    running.service._commit = slow

    async def scenario() -> tuple[float, float, int, int]:
        client = AsyncDraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=0.2))
        finished, live = await client.open([PROMPT, PROMPT])
        t0 = time.perf_counter()
        await client.close([finished])  # answered in the background: the decoder goes on
        closed_in = time.perf_counter() - t0
        await asyncio.sleep(0.05)  # the close is in the service, committing
        t0 = time.perf_counter()
        await client.draft([live], [[]])
        waited = time.perf_counter() - t0
        await client.shutdown()  # waits for the close
        return closed_in, waited, client.stats.remote, client.stats.fallback

    closed_in, waited, remote, fallback = asyncio.run(scenario())
    # Drafts have a stream of their own: the service drafted while the commit was running.
    assert closed_in < 0.2 and waited < 0.2 and (remote, fallback) == (1, 0)
    assert running.service.stats("toy")[0].requests == 1  # committed before shutdown returned


def test_stopping_ends_idle_streams_without_waiting_out_the_grace_period() -> None:
    running = start_service(ServiceConfig())
    _ns(running.target)
    client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0, retry_after_s=0))
    (session,) = client.open([PROMPT])
    client.draft([session], [[]])  # both streams are open now, and idle
    t0 = time.perf_counter()
    asyncio.run_coroutine_threadsafe(running.server.stop(5.0), running.loop).result(10)
    stopped_in = time.perf_counter() - t0
    running.channel.close()
    running.loop.call_soon_threadsafe(running.loop.stop)
    # The streams ended at once: the stop did not wait out its 5 s grace for them.
    assert stopped_in < 2.0
    client.draft([session], [[1]])  # the service is gone: the local drafter answers
    assert client.stats.remote == 1 and client.stats.fallback == 1
    client.shutdown()


def test_stopping_answers_the_draft_in_progress_then_ends_its_stream() -> None:
    running = start_service(ServiceConfig())
    _ns(running.target)
    draft_ahead = running.service.draft_ahead

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return draft_ahead(*args, **kwargs)

    client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=2.0))
    (session,) = client.open([PROMPT])
    client.draft([session], [[]])
    running.service.draft_ahead = slow  # type: ignore[method-assign]
    drafting = threading.Thread(target=client.draft, args=([session], [[TEXT[0]]]))
    drafting.start()
    time.sleep(0.1)  # the draft is being answered
    t0 = time.perf_counter()
    asyncio.run_coroutine_threadsafe(running.server.stop(5.0), running.loop).result(10)
    stopped_in = time.perf_counter() - t0
    drafting.join()
    running.channel.close()
    running.loop.call_soon_threadsafe(running.loop.stop)
    # The draft in progress was answered by the service; then every stream ended.
    assert client.stats.remote == 2 and client.stats.fallback == 0
    assert stopped_in < 2.0
    client.shutdown()


def test_a_refused_request_leaves_the_stream_open(running) -> None:  # type: ignore[no-untyped-def]
    _ns(running.target)  # vocabulary of 128
    client = DraftClient(ClientConfig(target=running.target, namespace="toy", retry_after_s=0))
    (lost,) = client.open([[*PROMPT, 500]])  # INVALID_ARGUMENT, answered on the control stream
    assert not lost.server_id and client.stats.failures == 1
    control = client._streams["control"]
    assert control.error is None  # the stream goes on
    (session,) = client.open([PROMPT])
    assert session.server_id and client._streams["control"] is control
    client.close([session])
    client.shutdown()


def test_sessions_closed_while_the_service_is_skipped_are_closed_at_shutdown(running) -> None:  # type: ignore[no-untyped-def]
    _ns(running.target)
    draft_ahead = running.service.draft_ahead

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return draft_ahead(*args, **kwargs)

    running.service.draft_ahead = slow
    # A missed deadline makes the client skip the service for 60 s.
    client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=0.01, retry_after_s=60))
    sessions = client.open([PROMPT, PROMPT])
    client.draft(sessions, [[], []])
    assert client.stats.failures == 1 and len(running.service.sessions) == 2
    client.close(sessions)  # skipped now: the copies are closed once the service is used again...
    assert len(running.service.sessions) == 2
    client.shutdown()  # ...or, at the latest, when the client shuts down
    assert len(running.service.sessions) == 0

    async def scenario() -> int:  # the same with the asyncio client
        from decoder_client.client import AsyncDraftClient

        aclient = AsyncDraftClient(
            ClientConfig(target=running.target, namespace="toy", deadline_s=0.01, retry_after_s=60)
        )
        sessions = await aclient.open([PROMPT, PROMPT])
        await aclient.draft(sessions, [[], []])
        await aclient.close(sessions)
        held = len(running.service.sessions)
        await aclient.shutdown()
        return held

    assert asyncio.run(scenario()) == 2 and len(running.service.sessions) == 0


def test_a_request_ended_while_its_open_is_under_way_is_counted_pending() -> None:
    """A close asked while the session's open still waits on a service that does not answer
    (a port that listens, never accepts) goes later, but its request already counts as not
    committed yet."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        target = f"127.0.0.1:{mute.getsockname()[1]}"
        client = DraftClient(ClientConfig(target=target, namespace="toy", deadline_s=0.05))
        (s,) = client.open([PROMPT], wait=False)
        client.draft([s], [[5]])
        client.close([s])
        assert client.stats.commits_pending == 1 and client.stats.commits_dropped == 0
        client.shutdown()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_requests_ended_through_an_outage_are_committed_in_parts(stream: bool) -> None:
    """More requests end while the service is down than one call may carry (its max_batch):
    once it answers, the client drafts from it again and commits them all, in parts (one open
    of them all was refused, again and again, and the sessions opened with it never were)."""
    port = free_port()
    config = ClientConfig(target=f"127.0.0.1:{port}", namespace="toy", deadline_s=0.05, stream=stream)
    client = DraftClient(config)
    ended = 300
    for i in range(ended):
        (s,) = client.open([[*PROMPT, i % 100]], wait=False)
        client.draft([s], [[i % 128]])
        client.close([s])
    assert client.stats.commits_pending == ended
    running = start_service(ServiceConfig(max_batch=256), port=port)
    try:
        _ns(running.target)
        (s,) = client.open([PROMPT], wait=False)

        def caught_up() -> bool:
            client.draft([s], [[]])
            return client.stats.commits_pending == 0 and client.stats.remote > 0

        eventually(caught_up)
        client.close([s])
        client.shutdown()
        assert client.stats.commits_dropped == 0
        assert len(running.service.sessions) == 0  # every copy closed
    finally:
        stop_service(running)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_server_that_predates_columnar_calls_gets_items(monkeypatch, stream: bool) -> None:  # type: ignore[no-untyped-def]
    from cache_service.rpc.servicer import DraftCacheServicer

    plain = DraftCacheServicer.Draft

    async def before_columns(self, request, context):  # type: ignore[no-untyped-def]
        request.ClearField("columns")  # all such a server reads of a columnar call
        return await plain(self, request, context)

    monkeypatch.setattr(DraftCacheServicer, "Draft", before_columns)
    running = start_service(ServiceConfig())
    try:
        _ns(running.target)
        client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=2.0, stream=stream))
        out, _ = _generate(client)
        assert out == TARGET.tolist()
        eventually(lambda: client.settle() or client.stats.reopened == 1)  # lands at a call after the close
        assert client.stats.fallback > 0 and client.stats.reopened == 1  # the first call got no trees
        fallback = client.stats.fallback
        out, steps = _generate(client)  # a new request: drafted by the service, in items
        assert out == TARGET.tolist()
        assert client.stats.fallback == fallback and client.stats.remote >= steps
        client.shutdown()
    finally:
        stop_service(running)


def test_columnar_calls_draft_what_item_calls_draft() -> None:
    results = []
    for columns in (True, False):
        running = start_service(ServiceConfig())
        try:
            _ns(running.target)
            client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=2.0))
            client._core.columns = columns
            results.append(_generate(client))
            assert client.stats.fallback == 0
        finally:
            stop_service(running)
    assert results[0] == results[1] and results[0][1] < 14


def _first_close_fails(monkeypatch) -> list[list[tuple[str, bool, list[int]]]]:  # type: ignore[no-untyped-def]
    """The service's CloseSessions fails once (UNAVAILABLE), then works; each call's sessions
    ``(id, commit, new tokens)`` are recorded in the list returned."""
    from cache_service.domain.errors import Unavailable
    from cache_service.rpc.servicer import DraftCacheServicer

    plain = DraftCacheServicer.CloseSessions
    calls: list[list[tuple[str, bool, list[int]]]] = []

    async def flaky(self, request, context):  # type: ignore[no-untyped-def]
        calls.append([(s.session_id, s.commit, list(s.new_tokens)) for s in request.sessions])
        if len(calls) == 1:
            raise Unavailable("storage is down")
        return await plain(self, request, context)

    monkeypatch.setattr(DraftCacheServicer, "CloseSessions", flaky)
    return calls


def _committed_after_all(running, calls, sid: str, stats: ClientStats) -> None:  # type: ignore[no-untyped-def]
    """The close with commit failed; at shutdown the client committed the request once more
    (a new copy of the whole sequence, closed with commit) and ended the first copy without."""
    assert calls[0] == [(sid, True, [77])] and calls[2] == [(sid, False, [])]
    ((again, commit, new),) = calls[1]
    assert again != sid and commit and new == []
    assert stats.failures == 1 and stats.commits_retried == 1 and stats.commits_dropped == 0
    assert not running.service.sessions.holds(sid) and not running.service.sessions.holds(again)
    (ns,) = running.service.stats("toy")
    assert ns.requests == 1 and ns.buffered_tokens == len(PROMPT) + 2  # the prompt, 77 and a separator: once


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_close_that_fails_in_the_background_is_committed_once_the_service_answers(monkeypatch, stream: bool) -> None:  # type: ignore[no-untyped-def]
    calls = _first_close_fails(monkeypatch)
    running = start_service(ServiceConfig())
    try:
        _ns(running.target)
        client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0, stream=stream))
        (session,) = client.open([PROMPT])
        sid = session.server_id
        client.draft([session], [[]])
        client.add_tokens([session], [[77]])  # the last step's tokens go with the close
        client.close([session])  # returns at once; the failure is booked later
        client.shutdown()
        _committed_after_all(running, calls, sid, client.stats)
    finally:
        stop_service(running)


def test_a_session_opened_without_waiting_drafts_locally_until_its_open_lands(running) -> None:  # type: ignore[no-untyped-def]
    from cache_service.rpc.servicer import DraftCacheServicer

    _ns(running.target)
    gate = threading.Event()
    plain = DraftCacheServicer.OpenSessions

    async def held(self, request, context):  # type: ignore[no-untyped-def]
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 5)
        return await plain(self, request, context)

    DraftCacheServicer.OpenSessions = held  # type: ignore[method-assign]
    try:
        client = DraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0))
        t0 = time.perf_counter()
        (session,) = client.open([[*TEXT, *TEXT[:4]]], wait=False)
        (first,) = client.draft([session], [[]])  # the open is held in the service: a local draft
        assert time.perf_counter() - t0 < 0.5 and not session.server_id
        assert client.stats.fallback == 1 and first.tokens.tolist()[:2] == TEXT[4:6]  # prompt lookup drafted
        gate.set()
        for _ in range(100):
            client.draft([session], [[]])
            if client.stats.remote:
                break
            time.sleep(0.02)
        assert session.server_id and client.stats.remote == 1
        assert running.service.sessions.get(session.server_id).session.context.tokens.tolist() == [*TEXT, *TEXT[:4]]
        client.close([session])
        client.shutdown()
    finally:
        DraftCacheServicer.OpenSessions = plain  # type: ignore[method-assign]
        gate.set()


def test_the_async_client_books_a_close_that_fails_in_the_background(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from decoder_client.client import AsyncDraftClient

    calls = _first_close_fails(monkeypatch)
    running = start_service(ServiceConfig())

    async def scenario() -> tuple[str, ClientStats]:
        client = AsyncDraftClient(ClientConfig(target=running.target, namespace="toy", deadline_s=1.0))
        (session,) = await client.open([PROMPT])
        sid = session.server_id
        client.add_tokens([session], [[77]])  # the last step's tokens go with the close
        await client.close([session])
        await client.shutdown()
        return sid, client.stats

    try:
        _ns(running.target)
        sid, stats = asyncio.run(scenario())
        _committed_after_all(running, calls, sid, stats)
    finally:
        stop_service(running)


def test_an_open_without_waiting_may_still_land_within_a_bound(running) -> None:  # type: ignore[no-untyped-def]
    from decoder_client.client import AsyncDraftClient

    _ns(running.target)
    config = ClientConfig(target=running.target, namespace="toy", deadline_s=1.0)
    client = DraftClient(config)
    (quick,) = client.open([PROMPT], wait=False, wait_s=2.0)
    assert quick.server_id and client.stats.failures == 0  # landed in time: its first draft is remote
    client.draft([quick], [[]])
    assert client.stats.remote == 1 and client.stats.fallback == 0
    client.close([quick])
    client.shutdown()

    async def scenario() -> tuple[str, int]:
        aclient = AsyncDraftClient(config)
        (s,) = await aclient.open([PROMPT], wait=False, wait_s=2.0)
        opened = s.server_id
        await aclient.draft([s], [[]])
        await aclient.close([s])
        await aclient.shutdown()
        return opened, aclient.stats.remote

    opened, remote = asyncio.run(scenario())
    assert opened and remote == 1  # the asyncio client alike


def test_a_second_shutdown_does_nothing_though_commits_are_still_kept() -> None:
    config = ClientConfig(target=f"127.0.0.1:{free_port()}", namespace="toy", control_timeout_s=0.5)
    client = DraftClient(config)  # nobody listens there
    client.commit([PROMPT])
    client.shutdown()
    assert client.stats.commits_pending == 1
    client.shutdown()  # an engine's exit hook after its own: no call on the closed channel

    async def scenario() -> int:
        from decoder_client.client import AsyncDraftClient

        aclient = AsyncDraftClient(config)
        await aclient.close(await aclient.open([PROMPT]), commit=True)  # drafted locally, kept to commit
        await aclient.shutdown()
        await aclient.shutdown()
        return aclient.stats.commits_pending

    assert asyncio.run(scenario()) == 1

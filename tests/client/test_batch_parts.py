"""A decoder batch larger than the service's ``max_batch`` (an engine running more requests than
one call may carry) against a real ``draftcache serve`` on its embedded Redis: the client sends
each step's draft, and its opens, in parts the service takes, under the step's one deadline; a
part that fails leaves only its own sessions to the local fallback; a service started with a
lower ``--max-batch`` names it when it refuses a part, and the client keeps to it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from draftcache.v1 import draftcache_pb2 as pb

from decoder_client.client import AsyncDraftClient, ClientConfig, ClientSession, ClientStats, DraftClient
from decoder_client.engines.settings import EngineSettings
from tests.faults import Serve, log_entries, wait_for

TEXT = [5, 17, 23, 42, 8, 15, 16, 4, 99, 7, 31, 64, 2, 11, 13, 21]
VOCAB = 128
STEPS = 3
DEADLINE_S = 2.0  # generous: these tests count where trees came from, not how fast
TRANSPORTS = ["stream", "unary", "async-stream", "async-unary"]
CLOSE = 16  # sessions ended in one close: what either service takes
_names = itertools.count()


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    running = Serve(tmp_path_factory.mktemp("serve") / "data").start()  # --max-batch 256, the default
    yield running
    running.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    running = Serve(tmp_path_factory.mktemp("small") / "data", "--max-batch", "16").start()
    yield running
    running.close()


def _config(serve: Serve, **kw: Any) -> ClientConfig:
    """A client of a namespace of its own on ``serve``."""
    ns = f"batch{next(_names)}"
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=ns, vocab_size=VOCAB), timeout=30)
    kw.setdefault("control_timeout_s", 30.0)  # an open of 300 on a loaded host: not what is counted
    return ClientConfig(target=f"127.0.0.1:{serve.port}", namespace=ns, deadline_s=DEADLINE_S, **kw)


def _prompts(n: int) -> list[list[int]]:
    return [[*TEXT, i % 100] for i in range(n)]


def _produced(step: int, n: int) -> list[list[int]]:
    return [[TEXT[step]]] * n


def _steps(transport: str, config: ClientConfig, n: int) -> ClientStats:
    """Open ``n`` sessions in one call, draft :data:`STEPS` steps of them all; the client's
    stats after the last step (then the sessions are closed, :data:`CLOSE` at a time)."""
    if transport.startswith("async"):
        return asyncio.run(_async_steps(config, n))
    client = DraftClient(config)
    sessions = client.open(_prompts(n))
    for step in range(STEPS):
        client.draft(sessions, _produced(step, n), deadline_s=DEADLINE_S)
    stats = dataclasses.replace(client.stats)
    _close(client, sessions, CLOSE)
    client.shutdown()
    return stats


async def _async_steps(config: ClientConfig, n: int) -> ClientStats:
    client = AsyncDraftClient(config)
    sessions = await client.open(_prompts(n))
    for step in range(STEPS):
        await client.draft(sessions, _produced(step, n), deadline_s=DEADLINE_S)
    stats = dataclasses.replace(client.stats)
    for at in range(0, n, CLOSE):
        await client.close(sessions[at : at + CLOSE], commit=False)
    await client.shutdown()
    return stats


def _close(client: DraftClient, sessions: Sequence[ClientSession], size: int, commit: bool = False) -> None:
    for at in range(0, len(sessions), size):
        client.close(sessions[at : at + size], commit=commit)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_batch_over_the_services_max_batch_drafts_from_it(serve: Serve, transport: str) -> None:
    """300 sessions, more than the service takes in one call (256): every step's trees come from
    the service, in two calls a step. (One call of them all was refused whole, and every
    session drafted locally at every step.)"""
    stats = _steps(transport, _config(serve, stream="unary" not in transport), 300)
    assert (stats.remote, stats.fallback, stats.failures) == (300 * STEPS, 0, 0)
    assert stats.draft_calls == 2 * STEPS


def test_an_engine_drafting_through_the_service_drafts_a_batch_over_max_batch_from_it(serve: Serve) -> None:
    """The client a vLLM or llama.cpp proposer builds with ``near`` false (chains, continued
    ones drafted in the background), for 300 running requests admitted at once, opened as
    vLLM's proposer opens them: in the background, waiting a while for the opens to land
    (here long enough for both parts)."""
    config = _config(serve)
    settings = EngineSettings(namespace=config.namespace, target=config.target, near=False)
    client = settings.draft_client(4, vocab_size=VOCAB)
    assert isinstance(client, DraftClient)
    sessions = client.open(_prompts(300), wait=False, wait_s=DEADLINE_S)
    assert all(s.server_id for s in sessions)
    for step in range(STEPS):
        client.draft(sessions, _produced(step, 300), deadline_s=DEADLINE_S)
    assert (client.stats.remote, client.stats.fallback, client.stats.failures) == (300 * STEPS, 0, 0)
    _close(client, sessions, CLOSE)
    client.shutdown()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_failed_part_falls_back_for_its_own_sessions_only(serve: Serve, stream: bool) -> None:
    """One part's call fails (a session of it is unknown to the service, which refuses that call
    whole): the other part's trees still come from the service in that step, and only the
    failed part's sessions draft locally and are opened again."""
    client = DraftClient(_config(serve, stream=stream, retry_after_s=0.05))
    sessions = [s for at in (0, 150) for s in client.open(_prompts(300)[at : at + 150])]
    gone = pb.CloseSession(session_id=sessions[260].server_id, commit=False, missing_ok=True)  # in the second part
    client.draft(sessions, _produced(0, 300), deadline_s=DEADLINE_S)
    serve.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[gone]), timeout=10)
    remote, fallback = client.stats.remote, client.stats.fallback
    client.draft(sessions, _produced(1, 300), deadline_s=DEADLINE_S)
    assert (client.stats.remote - remote, client.stats.fallback - fallback) == (256, 44)
    assert all(s.server_id for s in sessions[:256]) and not any(s.server_id for s in sessions[256:])

    def all_remote_again() -> bool:  # the 44 are opened again in the background
        before = client.stats.fallback
        client.draft(sessions, [[]] * 300, deadline_s=DEADLINE_S)
        return client.stats.fallback == before

    wait_for(all_remote_again, 10, "every session drafting from the service again")
    _close(client, sessions, CLOSE)
    client.shutdown()


def test_a_client_set_to_the_services_lower_limit_drafts_from_it_at_once(small: Serve) -> None:
    stats = _steps("stream", _config(small, max_batch=16), 40)
    assert (stats.remote, stats.fallback, stats.failures, stats.draft_calls) == (40 * STEPS, 0, 0, 3 * STEPS)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_learns_a_lower_limit_from_the_services_refusal(small: Serve, transport: str) -> None:
    """A service started with ``--max-batch 16`` and a client left at 256: its open of 40 is
    refused, naming 16, and sent again in parts of 16; every step then drafts from the service
    in three calls. (Every call of the 40 was refused, and they drafted locally for ever.)"""
    stats = _steps(transport, _config(small, stream="unary" not in transport), 40)
    assert (stats.remote, stats.fallback, stats.failures, stats.draft_calls) == (40 * STEPS, 0, 1, 3 * STEPS)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_draft_refused_for_its_size_changes_nothing_and_its_tokens_go_with_the_next_call(
    small: Serve, stream: bool
) -> None:
    """Sessions opened a few at a time, then drafted 40 at once against ``--max-batch 16``: that
    step drafts locally (the service refused the call before reading it), the copies are kept,
    not re-opened, and the step's tokens go with the next call, in parts: each request is
    committed with every token once."""
    config = _config(small, stream=stream)
    client = DraftClient(config)
    sessions = [s for at in range(0, 40, 14) for s in client.open(_prompts(40)[at : at + 14])]
    client.draft(sessions, _produced(0, 40), deadline_s=DEADLINE_S)
    assert (client.stats.remote, client.stats.fallback, client.stats.failures) == (0, 40, 1)
    assert all(s.server_id for s in sessions) and all(s.pending == [TEXT[0]] for s in sessions)
    for step in range(1, STEPS):
        client.draft(sessions, _produced(step, 40), deadline_s=DEADLINE_S)
    assert (client.stats.remote, client.stats.fallback, client.stats.reopened) == (40 * (STEPS - 1), 40, 0)
    _close(client, sessions, CLOSE, commit=True)
    client.shutdown()
    ended = sorted([*prompt, *TEXT[:STEPS]] for prompt in _prompts(40))
    wait_for(lambda: sorted(log_entries(small.redis_url(), config.namespace)) == ended, 10, "the commits")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_close_over_the_services_max_batch_commits_every_request_at_once(small: Serve, transport: str) -> None:
    """40 requests ended in one close against ``--max-batch 16`` (a client set to the service's
    limit): the close goes as three calls and every commit lands at the first try. (One close
    of 40 was refused whole: every request was kept, opened again whole and committed late.)"""
    config = _config(small, stream="unary" not in transport, max_batch=16)
    ended = sorted([*prompt, TEXT[0], TEXT[0]] for prompt in _prompts(40))  # drafted after one, then one more
    if transport.startswith("async"):

        async def scenario() -> ClientStats:
            client = AsyncDraftClient(config)
            sessions = await client.open(_prompts(40))
            await client.draft(sessions, _produced(0, 40), deadline_s=DEADLINE_S)
            client.add_tokens(sessions, [[TEXT[0]]] * 40)
            await client.close(sessions)
            await client.shutdown()
            return client.stats

        stats = asyncio.run(scenario())
    else:
        client = DraftClient(config)
        sessions = client.open(_prompts(40))
        client.draft(sessions, _produced(0, 40), deadline_s=DEADLINE_S)
        client.add_tokens(sessions, [[TEXT[0]]] * 40)
        client.close(sessions)
        client.shutdown()
        stats = client.stats
    assert (stats.commits_retried, stats.commits_dropped, stats.failures) == (0, 0, 0)
    wait_for(lambda: sorted(log_entries(small.redis_url(), config.namespace)) == ended, 10, "the commits")


def test_copies_given_up_on_are_closed_in_parts_the_service_takes(small: Serve) -> None:
    """Server copies a client gave up on (opens whose answer it never saw) are closed once the
    service answers again (its next open lands), in parts no larger than its ``--max-batch``
    (16): none is left to the session TTL. (Parts of 64 were refused at every try.)"""
    config = _config(small, max_batch=16)
    client = DraftClient(config)

    def live() -> int:
        return int(small.admin.Stats(pb.StatsRequest(namespace=config.namespace), timeout=10).namespaces[0].sessions)

    sessions = client.open(_prompts(40))
    assert live() == 40
    client._core.abandon(s.server_id for s in sessions)  # as a failed open does with its chosen ids
    for s in sessions:
        s.server_id = ""
    client.open(_prompts(1))  # the service answers: the copies given up on are closed
    wait_for(lambda: (client.settle(), live())[1] == 1, 10, "the copies to close")
    client.shutdown()

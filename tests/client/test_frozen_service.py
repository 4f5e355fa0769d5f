"""The client against a ``draftcache serve`` that is frozen (SIGSTOP: its port takes calls,
nothing answers them): ending a request never waits on it, and what was ended is committed
once it answers again."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator

import pytest
from draftcache.v1 import draftcache_pb2 as pb

from decoder_client.client import AsyncDraftClient, ClientConfig, DraftClient
from tests.faults import Serve, log_entries, wait_for

HELD = [5, 17, 23, 42, 8, 15, 16, 4, 99, 7]  # opened while the service answers
FRESH = [31, 64, 2, 11, 13, 21, 3, 9]  # opened once it is frozen
QUICK_S = 0.2  # a close that waited on the service would take the control timeout (1 s)
ENDED = sorted([[*HELD, 77], [*FRESH, 88]])  # what the two requests commit


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    running = Serve(tmp_path_factory.mktemp("serve") / "data").start()
    yield running
    running.close()


def _config(serve: Serve, ns: str, stream: bool) -> ClientConfig:
    serve.admin.CreateNamespace(pb.CreateNamespaceRequest(name=ns, vocab_size=128), timeout=30)
    return ClientConfig(
        target=f"127.0.0.1:{serve.port}", namespace=ns, deadline_s=0.005, control_timeout_s=1.0, stream=stream
    )


def _committed(serve: Serve, ns: str) -> bool:
    return sorted(log_entries(serve.redis_url(), ns)) == ENDED


async def _settle_until(client: AsyncDraftClient, done: Callable[[], object]) -> None:
    """The asyncio client's ``settle`` until ``done()`` (10 s at most), as an idle decoder
    settles: what the sync tests wait for with ``wait_for(lambda: client.settle() or done())``."""
    for _ in range(200):
        await client.settle()
        if done():
            return
        await asyncio.sleep(0.05)


def _sync_closes(serve: Serve, config: ClientConfig) -> float:
    """The time two closes took while the service was frozen: one of a session whose draft call
    was still under way, one of a session whose open was. Once it answers again, an idle
    decoder's ``settle`` sends what they left to do."""
    client = DraftClient(config)
    (held,) = client.open([HELD])
    serve.freeze()
    try:
        (fresh,) = client.open([FRESH], wait=False)
        client.draft([held, fresh], [[77], [88]])  # neither is answered: local drafts
        start = time.perf_counter()
        client.close([held])
        client.close([fresh])
        took = time.perf_counter() - start
    finally:
        serve.thaw()
    wait_for(lambda: client.settle() or _committed(serve, config.namespace), 10, "the commits")
    client.shutdown()
    return took


def _async_closes(serve: Serve, config: ClientConfig) -> float:
    """:func:`_sync_closes` with the asyncio client."""

    async def scenario() -> float:
        client = AsyncDraftClient(config)
        (held,) = await client.open([HELD])
        serve.freeze()
        try:
            (fresh,) = await client.open([FRESH], wait=False)
            await client.draft([held, fresh], [[77], [88]])
            start = time.perf_counter()
            await client.close([held])
            await client.close([fresh])
            took = time.perf_counter() - start
        finally:
            serve.thaw()
        await _settle_until(client, lambda: _committed(serve, config.namespace))
        await client.shutdown()
        return took

    return asyncio.run(scenario())


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize("closes", [_sync_closes, _async_closes], ids=["sync", "async"])
def test_close_never_waits_on_a_frozen_service(serve: Serve, closes, stream: bool) -> None:  # type: ignore[no-untyped-def]
    ns = f"frozen-{closes.__name__.strip('_')}-{'stream' if stream else 'unary'}"
    took = closes(serve, _config(serve, ns, stream))
    assert took < QUICK_S, f"close waited {took:.3f} s on a frozen service"
    # Once the service answered again, each request reached its lifetime log, once.
    assert sorted(log_entries(serve.redis_url(), ns)) == ENDED


def _last_step_sync(serve: Serve, config: ClientConfig) -> list[int]:
    """A request whose last step's token is recorded while the call drafting ahead for its step
    before is under way, then closed while the service is frozen: what it commits."""
    client = DraftClient(config)
    (s,) = client.open([HELD])
    client.draft([s], [[]])
    client.draft([s], [[77]])  # delivered by the call drafting ahead, in the background
    serve.freeze()
    try:
        client.add_tokens([s], [[88]])
        client.close([s])  # the call drafting ahead misses its time: booked late
    finally:
        serve.thaw()
    wait_for(lambda: client.settle() or log_entries(serve.redis_url(), config.namespace), 10, "the commit")
    client.shutdown()
    return s.tokens()


def _last_step_async(serve: Serve, config: ClientConfig) -> list[int]:
    """:func:`_last_step_sync` with the asyncio client."""

    async def scenario() -> list[int]:
        client = AsyncDraftClient(config)
        (s,) = await client.open([HELD])
        await client.draft([s], [[]])
        await client.draft([s], [[77]])
        serve.freeze()
        try:
            client.add_tokens([s], [[88]])
            await client.close([s])
        finally:
            serve.thaw()
        await _settle_until(client, lambda: log_entries(serve.redis_url(), config.namespace))
        await client.shutdown()
        return s.tokens()

    return asyncio.run(scenario())


@pytest.mark.parametrize("last_step", [_last_step_sync, _last_step_async], ids=["sync", "async"])
def test_a_last_step_recorded_while_drafting_ahead_is_committed(serve: Serve, last_step) -> None:  # type: ignore[no-untyped-def]
    ns = f"frozen-ahead-{last_step.__name__.rsplit('_', 1)[1]}"
    config = dataclasses.replace(_config(serve, ns, stream=True), lookahead=1)
    tokens = last_step(serve, config)
    assert tokens == [*HELD, 77, 88]
    assert log_entries(serve.redis_url(), ns) == [tokens]  # the last step's token too, once


def test_a_draft_cancelled_on_a_frozen_service_is_committed_once(serve: Serve) -> None:
    """A task awaiting the asyncio client's draft is cancelled while its call waits on the
    service (the call goes on on the stream): the client stays usable and the request's
    tokens are committed once each, none sent twice."""
    config = _config(serve, "frozen-cancelled", stream=True)
    unretrieved: list[str] = []

    async def scenario() -> list[int]:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx["message"]))
        client = AsyncDraftClient(config)
        (s,) = await client.open([HELD])
        await client.draft([s], [[]])
        serve.freeze()
        try:
            task = asyncio.ensure_future(client.draft([s], [[77]], deadline_s=5.0))
            await asyncio.sleep(0.1)  # its call is on the stream, unanswered
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            serve.thaw()
        for _ in range(200):  # drafts go on (locally while the copy is re-opened, then remote)
            await client.draft([s], [[]])
            if client.stats.remote >= 2:
                break
            await asyncio.sleep(0.01)
        await client.draft([s], [[88]])
        await client.close([s])
        await _settle_until(client, lambda: log_entries(serve.redis_url(), config.namespace))
        await client.shutdown()
        return s.tokens()

    tokens = asyncio.run(scenario())
    gc.collect()
    assert tokens == [*HELD, 77, 88]
    assert log_entries(serve.redis_url(), config.namespace) == [tokens]
    assert not unretrieved

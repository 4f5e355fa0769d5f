"""One decode step's draft as a plan of I/O steps, written once for the sync and asyncio clients.

:func:`draft_step` is a generator: it books everything in the core itself and yields an
effect each time the step needs the service (wait for earlier calls, re-open sessions, a draft
call, a call drafting ahead). The client performs the effect with its own transport and sends
back what a :class:`Draft` got (nothing, for the others), so the order of a step lives here
and a client holds only I/O.

>>> from decoder_client.client.config import ClientConfig
>>> from decoder_client.client.core import ClientCore, prompt_lookup_fallback
>>> core = ClientCore(ClientConfig(target="x", namespace="ns"), prompt_lookup_fallback)
>>> s = ClientSession([1, 2, 3, 1, 2], 5)  # no server copy yet: the step drafts locally
>>> step = draft_step(core, [s], [[]])
>>> [type(next(step)).__name__, type(step.send(None)).__name__]
['CatchUp', 'Reopen']
>>> try:
...     step.send(None)
... except StopIteration as done:
...     done.value[0].tokens.tolist()
[3, 1, 2]
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from draftcache.v1 import draftcache_pb2 as pb

from decoder_client.client.core import ClientCore
from decoder_client.client.session import ClientSession, TopkRows
from indexer.tree_builder import DraftTree


@dataclass(frozen=True)
class CatchUp:
    """Book the calls earlier steps left under way, waiting for them at most until ``end``
    (``time.monotonic()``)."""

    end: float


@dataclass(frozen=True)
class Reopen:
    """Start opening (in the background) those of ``sessions`` without a server copy, once no
    earlier open is under way; book an earlier one that ended."""

    sessions: Sequence[ClientSession]


@dataclass(frozen=True)
class Draft:
    """Send ``requests`` (one, or the parts of a batch larger than the service takes in one
    call) at once and wait at most ``left`` seconds for their replies: send back a
    :class:`Drafted` for each, in order."""

    requests: list[pb.DraftRequest]
    left: float


@dataclass(frozen=True)
class DraftAhead:
    """Send each part's request for its sessions without waiting: they are settled at the
    next step's :class:`CatchUp`."""

    parts: list[tuple[list[ClientSession], pb.DraftRequest]]


Effect = CatchUp | Reopen | Draft | DraftAhead


@dataclass(frozen=True)
class Drafted:
    """What one call of a :class:`Draft` got: the reply (None: the call failed or was late)
    and, on a stream, the call still under way after missing its time (see
    :meth:`ClientCore.missed`). ``oversized``: the service refused it as more sessions than it
    takes in a call, and applied none of it (the copies missed nothing: see
    :meth:`ClientCore.failed`)."""

    response: pb.DraftResponse | None
    late: Any = None
    oversized: bool = False


def draft_step(
    core: ClientCore,
    sessions: Sequence[ClientSession],
    new_tokens: Sequence[Sequence[int]],
    topk: Sequence[TopkRows | None] | None = None,
    deadline_s: float | None = None,
) -> Generator[Effect, list[Drafted] | None, list[DraftTree]]:
    """Append each session's new tokens (with their top-k rows, where given), then one tree per
    session (remote or fallback), within ``deadline_s`` (None: the client's).

    The sessions go in one call, or, more than the service takes in one (the client's
    ``max_batch``), in parts of at most that many sent together under the same deadline: a
    part that fails or is late leaves its own sessions to the fallback.

    A session whose outcome was drafted ahead gets that tree at once; the call delivering its
    tokens (and drafting ahead for its next outcome) is yielded as :class:`DraftAhead`. With
    ``lookahead`` the draft call itself asks for nothing ahead: the sessions it answered ask
    again in that background call, with no new tokens, for the outcomes ahead of the tree just
    sent (the service holds it and drafts only what lies ahead of it), so drafting ahead never
    delays a step's draft.
    """
    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    end = time.monotonic() + (core.config.deadline_s if deadline_s is None else deadline_s)
    yield CatchUp(end)
    core.add_tokens(sessions, new_tokens, topk)
    yield Reopen(sessions)
    ready, rest = core.split_ahead(sessions, new_tokens)
    trees = yield from _draft_rest(core, rest, end)
    # Answered by the service: a server copy holding every token (a failed or late call
    # leaves the tokens pending, or the copy in doubt).
    again = [s for s in rest if s.server_id and not s.pending] if core.config.lookahead else []
    if ready or again:
        ahead = [s for s in sessions if id(s) in ready] + again
        parts = core.draft_parts(ahead)
        if parts:
            yield DraftAhead(parts)
    if not ready:  # nothing was drafted ahead: every tree is fresh, in order
        return trees
    fresh = dict(zip(map(id, rest), trees, strict=True))
    return [ready[id(s)] if id(s) in ready else fresh[id(s)] for s in sessions]


def _draft_rest(
    core: ClientCore, rest: list[ClientSession], end: float
) -> Generator[Effect, list[Drafted] | None, list[DraftTree]]:
    """Trees for the sessions nothing was drafted ahead for: one call (or one per part) within
    what is left of the step's deadline, the fallback wherever it does not answer."""
    parts = core.draft_parts(rest, ahead=False)  # drafting ahead goes in the background (see draft_step)
    left = end - time.monotonic()
    got = (yield Draft([req for _, req in parts], left)) if parts and left > 0 else None
    if got is None:
        # Nothing sent (the service is being skipped, or the step's time is spent): the server
        # copies missed nothing, the tokens stay pending for the next call.
        return core.trees(rest, None, book=False)
    trees: list[DraftTree] = []
    for (part, _), drafted in zip(parts, got, strict=True):
        if drafted.late is not None:
            core.missed(part, drafted.late)
        book = drafted.late is None and not drafted.oversized  # a refused call left the copies as they were
        trees += core.trees(part, drafted.response, book=book)
    return trees

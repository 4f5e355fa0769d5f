"""The client's bookkeeping without I/O: what each server copy has heard, which calls to make,
what their answers (or failures) mean, and the local fallback drafts.

Both clients share it: they only perform the calls it asks for and hand it their outcomes.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from secrets import token_hex
from typing import Any

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb

from decoder_client import wire
from decoder_client.client.commits import CommitBacklog, commit_key, worth_retrying
from decoder_client.client.config import ClientConfig
from decoder_client.client.session import ClientSession, TopkRows
from indexer.prespeculation import continue_chain, select
from indexer.prompt_lookup import prompt_lookup_match
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)

Fallback = Callable[[np.ndarray, int], DraftTree]

# A namespace the service refuses to this client (FAILED_PRECONDITION: another vocabulary than
# its model's) is asked again this seldom: it stays wrong until an operator acts.
REFUSED_RETRY_S = 60.0

# How the service refuses a call larger than its ``max_batch`` (RESOURCE_EXHAUSTED, from
# cache_service.domain.admission.Admission.batch, checked before it reads anything else of the
# call): the limit it names is the client's from then on (see ClientCore.failed).
_OVERSIZED = re.compile(r"batch of \d+ exceeds the limit of (\d+)")

# Sessions one background open or close carries at most: a service refuses a call of more than
# its ``max_batch`` (256 by default), so the ended requests kept to commit and the copies given
# up on go in parts of this many.
BACKGROUND_BATCH = 64
# Server copies given up on kept to close: past this many (a long outage) the oldest are
# forgotten, and expire with the service's session TTL.
MAX_ABANDONED = 1 << 14


def parts(n: int, size: int = BACKGROUND_BATCH) -> int:
    """The background calls ``n`` sessions take (``size`` a call).

    >>> parts(0), parts(64), parts(65), parts(65, 16)
    (0, 1, 2, 5)
    """
    return -(-n // size)


# How likely a prompt-lookup chain's tokens are to be accepted, by the length of the n-gram it
# matched (1, 2, 3): the first token, and each later one once the one before it was. Measured
# over the Spec-Bench answers of SmolLM2 and Vicuna and swe_agent_dev, the lowest of the three
# (first: 0.21-0.25, 0.41-0.56, 0.70-0.85; later: 0.47-0.9, rising along the chain).
_LOOKUP_FIRST = np.array([0.21, 0.41, 0.70])
_LOOKUP_NEXT = np.array([0.55, 0.65, 0.83])


def prompt_lookup_fallback(context: np.ndarray, budget: int) -> DraftTree:
    """The local drafter: a prompt-lookup chain of at most ``budget`` tokens, each scored with
    its chance of being reached (so an engine cuts it where its tokens stop paying, as it cuts
    the service's chains).

    >>> t = prompt_lookup_fallback(np.array([5, 6, 7, 8, 9, 5, 6, 7], dtype=np.int32), 3)
    >>> t.tokens.tolist(), [round(float(s), 3) for s in t.scores]  # a 3-gram matched
    ([8, 9, 5], [0.7, 0.581, 0.482])
    """
    chain, n = prompt_lookup_match(context, num_tokens=max(0, min(budget, 10)))
    tree = DraftTree.chain(chain)
    if chain.size:
        reach = _LOOKUP_FIRST[n - 1] * _LOOKUP_NEXT[n - 1] ** np.arange(chain.size)
        tree.scores[:] = reach.astype(np.float32)
    return tree


@dataclass
class ClientStats:
    """What a client's steps came to, counted since it was made."""

    remote: int = 0  # trees that came from the service
    fallback: int = 0  # trees the local drafter made
    near: int = 0  # trees drafted in this process from a near copy of the namespace (see client.near)
    followed: int = 0  # other processes' requests a near copy took from the service's log (see client.follow)
    prior_version: int = 0  # the static prior a near copy read from the service (0: none; see client.prior_follow)
    failures: int = 0  # calls that failed or missed their deadline (a step's late parts count once)
    reopened: int = 0  # sessions opened with more than their prompt (an earlier copy was lost)
    ahead_hits: int = 0  # trees that were drafted ahead (no wait)
    ahead_misses: int = 0  # outcomes nothing had been drafted ahead for
    continued: int = 0  # chains that went on from the last one, which foresaw the outcome (no wait)
    lost_opens: int = 0  # opens given up on (deadline): the service may hold copies until they expire
    commits_retried: int = 0  # ended requests whose commit did not land at once (kept to send again)
    commits_dropped: int = 0  # ended requests never committed (the backlog was full, or the service refused them)
    commits_pending: int = 0  # ended requests not committed yet (close asked, kept, or under way), when last counted
    malformed: int = 0  # trees from the service not used: an id outside the vocabulary, a bad parent, too many nodes
    draft_calls: int = 0  # draft calls a step waited on (a batch over max_batch makes several) ...
    draft_wait_s: float = 0.0  # ... and the time from sending a step's calls to their replies (or to giving up on them)


_LateCall = tuple[list[tuple[ClientSession, str]], Any]  # (sessions with their server ids, the call)


@dataclass(frozen=True)
class Reopening:
    """An open sent in the background: the sessions it is for, their context sizes when it was
    sent (tokens added since stay pending) and the request (its copies are closed if it fails)."""

    sessions: list[ClientSession]
    sizes: list[int]
    request: pb.OpenSessionsRequest


class ClientCore:
    """The client's bookkeeping without I/O, shared by the sync and the asyncio client."""

    def __init__(self, config: ClientConfig, fallback: Fallback) -> None:
        self.config = config
        self.stats = ClientStats()
        self.fallback = fallback
        self.down_until = 0.0
        self.late_run = 0  # draft calls in a row past their deadline
        self.abandoned: list[str] = []  # server sessions given up on (closed when the service answers)
        self.late: list[_LateCall] = []  # see :meth:`missed`
        self.to_close: list[tuple[list[ClientSession], bool]] = []  # closes waiting on a call (see closes_due)
        self.commits = CommitBacklog(config.commit_backlog_tokens)  # ended requests not committed yet
        self.columns = True  # draft calls in columns (False once a server showed it predates them)
        wire.warm_up()  # the response reader is compiled now, not on the first step's deadline
        # And the fallback runs once: what it compiles (seconds on a fresh machine) must not
        # land on the first step the service misses, when the decoder has no time to spare.
        fallback(np.array([1, 2, 1], dtype=np.int32), 2)
        self.params = wire.params_to_proto(config.params)
        self.cut_chains_at(config.params.chain_min_prob)
        self._most_nodes = config.params.chain or config.params.budget  # what a tree may hold
        self._said_malformed = False
        self.refused = ""  # why the service refuses the namespace to this client ("": it does not)
        self.max_batch = config.max_batch  # sessions a call carries at most (lowered by the service: see failed)

    def cut_chains_at(self, min_prob: float) -> None:
        """Sessions opened from now on ask for chains cut at ``min_prob``; continued chains run
        on to ``chain_run_on`` of it (a step they foresaw has more of them left)."""
        if not 0 <= min_prob < 1:
            raise ValueError(f"chain_min_prob must be in [0, 1), got {min_prob}")
        run_on = self.config.chain_run_on if self.config.continue_chains else 1.0
        self.params.chain_min_prob = min_prob * run_on  # each open copies it
        self.chain_cut = min_prob

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    @contextlib.contextmanager
    def draft_call(self, calls: int = 1) -> Iterator[None]:
        """Count the draft ``calls`` a step waits on (sent together), and the time from sending
        them to their replies (or to giving up on them)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.draft_calls += calls
            self.stats.draft_wait_s += time.perf_counter() - start

    def failed(self, exc: grpc.RpcError | None) -> bool:
        """A call failed (``None``: it missed its deadline, and goes on in the background). The
        service is skipped a while after an error, or after ``late_before_skip`` misses in a
        row (an answer in time ends the row: :meth:`answered`).

        A call the service refused as more sessions than its ``max_batch`` is no fault of the
        service: it is not skipped, and where the limit it names is below this client's, the
        client's later calls are cut to it (a service started with a lower ``--max-batch``
        than ``ClientConfig.max_batch``). True for such a call: the service refused it before
        reading anything else of it, so it changed nothing (the copies missed no token).

        >>> from decoder_client.client import ClientConfig, prompt_lookup_fallback
        >>> core = ClientCore(ClientConfig(target="x", namespace="ns"), prompt_lookup_fallback)
        >>> core.failed(None), core.available()  # one late answer: the next call asks again
        (False, True)
        >>> core.failed(None), core.available()  # two in a row: skipped a while
        (False, False)
        >>> from decoder_client.client.protocol import RequestFailed
        >>> core = ClientCore(ClientConfig(target="x", namespace="ns"), prompt_lookup_fallback)
        >>> big = RequestFailed(pb.StreamError(code=8, message="batch of 300 exceeds the limit of 16"))
        >>> core.failed(big), core.available(), core.max_batch  # RESOURCE_EXHAUSTED: cut to 16
        (True, True, 16)
        """
        self.stats.failures += 1
        if exc is not None and self._oversized(exc):
            return True
        if exc is None:
            self.late_run += 1
            if self.late_run < self.config.late_before_skip:
                logger.debug("draftcache call missed its deadline (%d in a row)", self.late_run)
                return False
        self.down_until = time.monotonic() + self.config.retry_after_s
        why = "deadline" if exc is None else exc.code()
        logger.debug("draftcache call failed (%s); local drafts for %.1f s", why, self.config.retry_after_s)
        return False

    def _oversized(self, exc: grpc.RpcError) -> bool:
        """Whether the service refused the call for its size (see :data:`_OVERSIZED`); the
        limit it names, when below the client's, is the client's from now on."""
        if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        named = _OVERSIZED.search(exc.details() or "")
        if named is None:
            return False
        limit = max(1, int(named[1]))
        if limit < self.max_batch:
            logger.warning(
                "draftcache: the service takes at most %d sessions a call (max_batch is %d here): "
                "calls are cut to %d from now on",
                limit, self.max_batch, limit,
            )  # fmt: skip
            self.max_batch = limit
        return True

    def add_tokens(
        self,
        sessions: Sequence[ClientSession],
        new_tokens: Sequence[Sequence[int]],
        topk: Sequence[TopkRows | None] | None = None,
    ) -> None:
        rows = [None] * len(sessions) if topk is None else topk
        for s, new, top in zip(sessions, new_tokens, rows, strict=True):
            if len(new):
                s.extend(new, top, self.config.topk)

    def open_request(self, sessions: Sequence[ClientSession], *, now: bool = False) -> pb.OpenSessionsRequest | None:
        """Open those of ``sessions`` without a server copy, unless the service is being
        skipped (``now``: anyway)."""
        todo = [s for s in sessions if not s.server_id]
        if not todo or not (now or self.available()):
            return None
        ns = self.config.namespace
        return pb.OpenSessionsRequest(  # ids chosen here: an open given up on can still be closed
            sessions=[
                pb.OpenSession(
                    namespace=ns,
                    prompt=s.tokens(),
                    params=self.params,
                    session_id=token_hex(16),
                    vocab_size=self.config.vocab_size,
                    tokenizer=self.config.tokenizer,
                )
                for s in todo
            ]
        )

    def open_parts(self, sessions: Sequence[ClientSession]) -> list[tuple[list[ClientSession], pb.OpenSessionsRequest]]:
        """The opens of those of ``sessions`` without a server copy (none while the service is
        being skipped), each of at most :attr:`max_batch` sessions, with the sessions each is for."""
        todo = [s for s in sessions if not s.server_id]
        out = []
        for at in range(0, len(todo), self.max_batch):
            part = todo[at : at + self.max_batch]
            req = self.open_request(part)
            if req is not None:
                out.append((part, req))
        return out

    def open_failed(
        self, req: pb.OpenSessionsRequest, exc: grpc.RpcError, sessions: Sequence[ClientSession] = ()
    ) -> bool:
        """An open call failed: the service may still have made the sessions (a missed deadline
        above all), so they are closed, if they exist, once it answers again. Ended requests
        it was opening to commit (among ``sessions``) are given up on if the service refused them;
        all of them when it refuses the namespace (see :meth:`refuse`). True: the service
        refused it for its size and made none of them (they are opened again in smaller
        parts: see :meth:`failed`)."""
        if self.failed(exc):
            return True
        if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
            self.refuse(exc.details() or "")
            sessions = [*sessions, *self.commits.to_open()]
        if not worth_retrying(exc):
            self.commits.discard(sessions)
            self._commit_stats()
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            self.stats.lost_opens += len(req.sessions)
        self.abandon(s.session_id for s in req.sessions)
        return False

    def abandon(self, server_ids: Iterable[str]) -> None:
        """Close these server copies (without commit) once the service answers; at most
        :data:`MAX_ABANDONED` are kept, the oldest forgotten first."""
        self.abandoned.extend(server_ids)
        del self.abandoned[:-MAX_ABANDONED]

    def refuse(self, why: str) -> None:
        """The service refuses the namespace to this client (FAILED_PRECONDITION: the model's
        vocabulary is not the namespace's, so its ids mean other text there). Sessions draft
        locally and no ended request is kept to commit; the service is asked again every
        :data:`REFUSED_RETRY_S` (an operator may fix the namespace), and the reason is logged
        once, not at every request."""
        self.down_until = time.monotonic() + max(self.config.retry_after_s, REFUSED_RETRY_S)
        if why != self.refused:
            logger.error(
                "draftcache: the service refuses namespace %r to this client (%s); it drafts locally and commits "
                "nothing there, asking again every %.0f s",
                self.config.namespace, why, REFUSED_RETRY_S,
            )  # fmt: skip
        self.refused = why

    def opened(
        self, sessions: Sequence[ClientSession], resp: pb.OpenSessionsResponse, sizes: Sequence[int] | None = None
    ) -> None:
        """Book the server ids of an open request made for ``sessions`` (those without one);
        ``sizes``: their context sizes when it was sent (tokens added since are pending)."""
        if self.refused:
            logger.info("draftcache: the service takes namespace %r again", self.config.namespace)
            self.refused = ""
        todo = [s for s in sessions if not s.server_id]
        sizes = [len(s) for s in todo] if sizes is None else sizes
        for s, sid, size in zip(todo, resp.session_ids, sizes, strict=True):
            if s.prompt_len != size:
                self.stats.reopened += 1
            s.server_id, s.pending, s.pending_topk, s.pending_after = sid, s.tokens(size), [], []

    def reopen_request(self, sessions: Sequence[ClientSession], *, now: bool = False) -> Reopening | None:
        """An open, to send in the background, of those of ``sessions`` without a server copy
        (the first :attr:`max_batch` of them: the rest go in the next one), and of the ended
        requests still to commit, as many as :data:`BACKGROUND_BATCH` (or a lower
        :attr:`max_batch`) leaves room for (:meth:`commit_request` closes them next)."""
        if not (now or self.available()):
            return None
        todo = [s for s in sessions if not s.server_id][: self.max_batch]
        todo += self.commits.to_open(self.background_batch - len(todo))
        req = self.open_request(todo, now=now)
        return None if req is None else Reopening(todo, [len(s) for s in todo], req)

    def draft_parts(
        self, sessions: Sequence[ClientSession], *, ahead: bool = True
    ) -> list[tuple[list[ClientSession], pb.DraftRequest]]:
        """The draft calls for ``sessions`` (none where :meth:`draft_request` makes none): one,
        for them all, where they fit in :attr:`max_batch`; else ``sessions`` cut, in order, into
        parts of at most :attr:`max_batch` sessions with a server copy (a session without one
        goes along and drafts locally), each part with its call, to send together."""
        if len(sessions) <= self.max_batch:  # no count needed: a step that fits pays nothing for splitting
            req = self.draft_request(sessions, ahead=ahead)
            return [] if req is None else [(list(sessions), req)]
        cuts: list[list[ClientSession]] = [[]]
        held = 0
        for s in sessions:
            if s.server_id:
                if held == self.max_batch:
                    cuts.append([])
                    held = 0
                held += 1
            cuts[-1].append(s)
        out = []
        for part in cuts:
            req = self.draft_request(part, ahead=ahead)
            if req is None:  # none has a server copy, or the service is being skipped
                return []
            out.append((part, req))
        return out

    def draft_request(self, sessions: Sequence[ClientSession], *, ahead: bool = True) -> pb.DraftRequest | None:
        """The draft call for those of ``sessions`` with a server copy (None: none, or the
        service is being skipped): their pending tokens and top-k rows; with ``ahead``, the
        outcomes to draft ahead for too (the client's ``lookahead``)."""
        remote = [s for s in sessions if s.server_id]
        if not remote or not self.available():
            return None
        k, top_k = self.config.lookahead if ahead else 0, self.config.topk
        rows = [s.take_topk(top_k) or ([], []) for s in remote]  # (after, rows) each
        for s in remote:
            s.asked_at = len(s)
        if not self.columns:
            return pb.DraftRequest(
                items=[
                    pb.DraftItem(
                        session_id=s.server_id,
                        new_tokens=s.pending,
                        lookahead=k,
                        topk=r,
                        topk_k=top_k if r else 0,
                        topk_after=after,
                    )
                    for s, (after, r) in zip(remote, rows, strict=True)
                ]
            )
        pending = [s.pending for s in remote]
        cols = pb.DraftColumns(
            session_ids=[s.server_id for s in remote],
            new_token_counts=[len(p) for p in pending],
            new_tokens=[t for p in pending for t in p],
            lookahead=[k] * len(remote) if k else [],
        )
        if any(after for after, _ in rows):  # every session's rows named by the token each follows
            for s, (after, r) in zip(remote, rows, strict=True):
                named = after or (s.tokens(len(s) - len(s.pending) - 1)[: len(s.pending)] if r else [])
                cols.topk_after.extend(named)
                cols.topk_counts.append(len(named))
                cols.topk.extend(r)
            cols.topk_k = top_k
        elif any(r for _, r in rows):  # a row per new token: sessions without send -1 rows
            for p, (_, r) in zip(pending, rows, strict=True):
                cols.topk.extend(r or [-1] * (top_k * len(p)))
            cols.topk_k = top_k
        return pb.DraftRequest(columns=cols)

    def split_ahead(
        self, sessions: Sequence[ClientSession], new_tokens: Sequence[Sequence[int]]
    ) -> tuple[dict[int, DraftTree], list[ClientSession]]:
        """Trees already drafted ahead for what each session just produced, by session, and the
        sessions that still need a draft call."""
        ready: dict[int, DraftTree] = {}
        rest = []
        for s, new in zip(sessions, new_tokens, strict=True):
            tree = select(s.prefetched, new) if s.server_id and s.prefetched and len(new) else None
            s.prefetched = {}
            if tree is None and s.chain is not None and s.server_id and len(new):
                tree = self._continued(s.chain, s.tokens(s.chain_at))
                self.stats.continued += tree is not None
            if tree is None:
                if self.config.lookahead and s.server_id and len(new):
                    self.stats.ahead_misses += 1
                rest.append(s)
            else:
                self.stats.ahead_hits += 1
                self.stats.remote += 1
                ready[id(s)] = tree
        return ready, rest

    def _continued(self, chain: DraftTree, produced: Sequence[int]) -> DraftTree | None:
        """What ``chain`` still holds after ``produced`` (see
        :func:`~indexer.prespeculation.continue_chain`), where that is as much as the decoder
        would take of what a call brings: the rest still holds ``chain_take`` tokens, or more
        than the decoder takes of it (it runs below the decoder's cut). A sure chain taken whole
        (a request asked again) leaves a few tokens, where a call, drafting for the longer
        context, brings a whole chain again. (Whether the chain ended at the length asked or
        at the run-on chance says nothing here: its chances were reckoned from where it was
        drafted, and the tokens produced since make the next ones likelier.)"""
        rest = continue_chain(chain, produced)
        if rest is None or len(rest) >= self.config.chain_take:
            return rest
        # Or its last token is less likely than the decoder's cut: it would not take all of it.
        return rest if float(rest.scores[-1]) < self.chain_cut else None

    def in_doubt(self, sessions: Sequence[ClientSession]) -> None:
        """Their server copies may have missed tokens: they are closed, and the sessions
        re-opened with their full context later."""
        for s in sessions:
            if s.server_id:
                self.abandon([s.server_id])
                s.server_id = ""

    def ahead_late(self, calls: Sequence[tuple[Sequence[ClientSession], Any]]) -> list[Any]:
        """The calls drafting ahead, each for its sessions, that got no reply by the next step's
        deadline (one late answer, however many parts the step's call went in). On a stream
        each still counts once answered, so it is kept (see :meth:`missed`); a unary call is
        given up on and the copies are in doubt (those returned: the caller cancels them)."""
        self.failed(None)
        if self.config.stream:
            for sessions, call in calls:
                self.missed(sessions, call)
            return []
        for sessions, _ in calls:
            self.answered(sessions, None)
        return [call for _, call in calls]

    def missed(self, sessions: Sequence[ClientSession], call: Any) -> None:
        """A draft ``call`` missed its deadline on a stream. It still reaches the service, which
        answers in order: its tokens join the server copies before anything sent after it, so
        the sessions keep them (tokens added since the call was made, a last step's before a
        close, stay pending). The call is kept, with their server ids, to put them in doubt
        should it fail after all (:meth:`due`, :meth:`late_failed`)."""
        pairs = []
        for s in sessions:
            if s.server_id:
                s.heard()
                s.prefetched = {}
                pairs.append((s, s.server_id))
        self.late.append((pairs, call))

    def due(self, wait_for: Sequence[ClientSession] | None) -> list[_LateCall]:
        """The late calls to book now: those that ended, and those of ``wait_for`` (None: all),
        which the caller waits for; the others stay."""
        waiting = None if wait_for is None else {id(s) for s in wait_for}
        due: list[_LateCall] = []
        keep: list[_LateCall] = []
        for pairs, call in self.late:
            now = waiting is None or call.done() or any(id(s) in waiting for s, _ in pairs)
            (due if now else keep).append((pairs, call))
        self.late = keep
        return due

    def late_failed(self, pairs: Sequence[tuple[ClientSession, str]]) -> None:
        """A late call failed after all: the sessions still on the copies it went to are in doubt."""
        self.in_doubt([s for s, sid in pairs if s.server_id == sid])

    def answered(
        self,
        sessions: Sequence[ClientSession],
        resp: pb.DraftResponse | None,
        drafted: Sequence[DraftTree] | None = None,
    ) -> None:
        """Book a draft call's outcome: tokens delivered, trees drafted ahead and (to continue,
        in chain mode) the chains, the response's own unless ``drafted`` holds them already;
        or the sessions' server copies in doubt."""
        remote = [s for s in sessions if s.server_id]
        if resp is None:
            self.in_doubt(remote)
            return
        self.late_run = 0
        ahead: list[dict[tuple[int, ...], DraftTree]] = [{} for _ in remote]
        if len(resp.prefetched):
            try:
                ahead = wire.prefetched_from_response(resp, self.config.vocab_size)
            except ValueError as exc:
                logger.warning("draftcache: trees drafted ahead not used: %s", exc)
            if len(ahead) != len(remote):
                logger.warning("draftcache: trees drafted ahead for %d items, not %d", len(ahead), len(remote))
                ahead = [{} for _ in remote]
        for s, more in zip(remote, ahead, strict=True):
            s.heard()
            s.prefetched = more
        if self.config.continue_chains:
            chains = wire.trees_from_response(resp) if drafted is None else drafted
            if len(chains) == len(remote):  # each drafted for the context the call was made at
                for s, chain in zip(remote, chains, strict=True):
                    s.chain, s.chain_at = chain, s.asked_at

    def trees(
        self, sessions: Sequence[ClientSession], resp: pb.DraftResponse | None, *, book: bool = True
    ) -> list[DraftTree]:
        """Remote trees where the service answered, local ones everywhere else; ``book``: the
        call's outcome too (see :meth:`answered`)."""
        remote = [s for s in sessions if s.server_id]
        drafted: list[DraftTree] = []
        bad: list[bool] = []
        if resp is not None:
            try:
                drafted, bad = wire.checked_trees_from_response(resp, self.config.vocab_size, self._most_nodes)
            except ValueError as exc:  # no answer at all: every sequence drafts locally
                logger.warning("draftcache: a draft response not used: %s", exc)
                self.stats.malformed += len(remote)
                resp, bad = None, []
            if any(bad):  # those sequences draft locally
                self.stats.malformed += sum(bad)
                if not self._said_malformed:
                    logger.warning("draftcache: %d malformed trees from the service not used", sum(bad))
                    self._said_malformed = True
            if resp is None:
                pass
            elif len(drafted) == len(remote):
                self.stats.remote += len(remote) - sum(bad)
            else:  # not an answer to this call: the sessions' server copies are in doubt
                logger.warning("draft call for %d sessions answered with %d trees", len(remote), len(drafted))
                if remote and not drafted and self.columns:
                    # A server that predates columnar calls reads none of them and drafts nothing.
                    self.columns = False
                resp, drafted = None, []
        if book:
            self.answered(sessions, resp, drafted)
        if resp is not None and len(remote) == len(sessions) and not any(bad):  # answered for every sequence
            return drafted
        got = {}
        if resp is not None:
            got = {id(s): tree for s, tree, b in zip(remote, drafted, bad, strict=True) if not b}
        out = []
        for s in sessions:
            tree = got.get(id(s))
            if tree is None:
                self.stats.fallback += 1
                tree = self.fallback(s.context, self.config.params.chain or self.config.params.budget)
            out.append(tree)
        return out

    @property
    def background_batch(self) -> int:
        """Sessions one background call carries: :data:`BACKGROUND_BATCH`, or fewer where the
        service takes fewer (:attr:`max_batch`)."""
        return min(BACKGROUND_BATCH, self.max_batch)

    def abandoned_request(self, *, now: bool = False) -> pb.CloseSessionsRequest | None:
        """Close (without commit) the server sessions given up on, once the service is used
        again (``now``: anyway, the client is shutting down): :attr:`background_batch` of them,
        the rest at the next request."""
        if not self.abandoned or not (now or self.available()):
            return None
        n = self.background_batch
        ids, self.abandoned = self.abandoned[:n], self.abandoned[n:]
        return pb.CloseSessionsRequest(
            sessions=[pb.CloseSession(session_id=sid, commit=False, missing_ok=True) for sid in ids]
        )

    def ask_close(self, sessions: Sequence[ClientSession], commit: bool) -> None:
        """A close asked for: its request is made by :meth:`closes_due`, once it may go."""
        self.to_close.append((list(sessions), commit))
        self._commit_stats()

    def closes_due(self, opening: Sequence[ClientSession], *, now: bool = False) -> list[pb.CloseSessionsRequest]:
        """The requests of the closes asked for whose sessions wait on no call (``now``: all of
        them). A session in ``opening`` (its open under way) must wait for it: the close goes to
        the copy it makes. One with a late draft call on the stream must wait for it to end: the
        close travels on the other stream and would overtake the tokens (a call that failed puts
        the copy in doubt, and the request is then kept to commit). A close of more sessions
        than :attr:`max_batch` goes as several calls."""
        busy = {id(s) for pairs, _ in self.late for s, _ in pairs} | {id(s) for s in opening}
        due, waiting = [], []
        for sessions, commit in self.to_close:
            if not now and any(id(s) in busy for s in sessions):
                waiting.append((sessions, commit))
                continue
            for at in range(0, len(sessions), self.max_batch):
                close = self.close_request(sessions[at : at + self.max_batch], commit)
                if close is not None:
                    due.append(close)
        self.to_close = waiting
        self._commit_stats()
        return due

    def close_request(self, sessions: Sequence[ClientSession], commit: bool) -> pb.CloseSessionsRequest | None:
        """One call ending the sessions' server copies, each with its last step's tokens. It is
        sent in the background even while the service is being skipped (it costs the decoder
        nothing). With ``commit``, a session without a server copy (lost, never opened) is kept
        to commit later, as is one whose close fails (:meth:`close_settled`)."""
        live = [s for s in sessions if s.server_id]
        if commit:
            for s in sessions:
                s.commit_key = s.commit_key or commit_key()  # one per request, kept in every retry
                if not s.server_id:
                    self.keep_for_commit(s.tokens(), s.commit_key)
        if not live:
            return None
        close = pb.CloseSessionsRequest(
            sessions=[
                pb.CloseSession(
                    session_id=s.server_id,
                    commit=commit,
                    new_tokens=s.pending,
                    commit_key=s.commit_key if commit else "",
                )
                for s in live
            ]
        )
        for s in live:
            if commit:
                self.commits.sending(s.server_id, s.tokens(), s.commit_key)
            s.pending, s.server_id = [], ""
        return close

    def commit_request(self) -> pb.CloseSessionsRequest | None:
        """Close with commit the ended requests re-opened for it (see :class:`CommitBacklog`)."""
        return self.close_request(self.commits.ready(), commit=True)

    def keep_for_commit(self, tokens: list[int], key: str = "", *, retry: bool = True) -> None:
        """Commit ``tokens`` (a whole request) once the service takes it, under ``key`` (its
        commit's; "": a new one), (``retry``: a commit that did not land; False: a request's
        first). Dropped (counted) while the service refuses the namespace: it would refuse the
        commit too."""
        if self.refused:
            self.commits.dropped += 1
        else:
            self.abandon(self.commits.keep(tokens, key, retry=retry))
        self._commit_stats()

    def _commit_stats(self) -> None:
        self.stats.commits_retried, self.stats.commits_dropped = self.commits.kept, self.commits.dropped
        asked = sum(len(sessions) for sessions, commit in self.to_close if commit)  # closes waiting on an open
        self.stats.commits_pending = self.commits.unsent + asked

    def close_settled(self, req: pb.CloseSessionsRequest, exc: BaseException | None) -> None:
        """Book a close call run in the background: when it failed, its sessions are closed
        (without commit) once the service is used again, or at shutdown, and those it was to
        commit are kept to commit again."""
        ids = [c.session_id for c in req.sessions]
        if exc is not None:
            if isinstance(exc, grpc.RpcError):
                self.failed(exc)
            self.abandon(ids)
        self.abandon(self.commits.settled(ids, exc))
        self._commit_stats()

"""Drafting in the decoder's own process, from a near copy of a namespace: no call on a step's path.

A draft call to the service costs every step its round trip: on a CPU host, 2-3 ms after an
engine step left the transport idle, most of it the transport itself (see the measurements'
"Where a draft call's time goes"). A :class:`NearClient` drafts where the decoder runs instead,
with a :class:`~indexer.drafter.NamespaceDrafter` of its own: the same tiers, calibration and
chain mode the service drafts with, over each request's own context, the requests this process
finished (its own lifetime memory) and the namespace's static prior, loaded from the file the
operator warmed (``draftcache warm --out``, the file ``warm --from-prior`` publishes).

The service stays the fleet's memory: every request this process finishes is committed to it
too, in the background, through a :class:`~decoder_client.client.sync.DraftClient` (kept and
sent again while the service does not take it), so replicas drafting through the service learn
from it. And the near copy follows the service's lifetime log (every ``follow_s`` seconds, on a
thread of its own, :mod:`decoder_client.client.follow`): what other replicas commit after it
starts joins its lifetime memory when it next drafts, its own commits skipped. What they
committed before it started is read first: a new near copy indexes the log's newest entries (as
many tokens as its memory holds, for at most ``start_s`` seconds) before its first request, so
a replica that joins a running fleet drafts from the fleet's history at once.

It answers the calls an engine adapter makes of a :class:`~decoder_client.client.DraftClient`
(open, draft, add_tokens, close, settle, shutdown), so an adapter takes either.

>>> from decoder_client.client.config import ClientConfig
>>> from indexer.drafter import DraftParams
>>> near = NearClient(ClientConfig(target="127.0.0.1:1", namespace="n", params=DraftParams(chain=4)), 100)
>>> (s,) = near.open([[5, 6, 7, 8, 5, 6]])
>>> near.draft([s], [[]])[0].tokens.tolist()  # "5 6" was followed by "7 8", then "5 6" again
[7, 8, 5, 6]
>>> near.draft([s], [[99, 100]])
Traceback (most recent call last):
...
ValueError: new tokens: id 100 at position 1 is outside the vocabulary [0, 100)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from decoder_client.client.config import ClientConfig
from decoder_client.client.core import ClientStats
from decoder_client.client.follow import FOLLOW_S, LogFollower, OwnCommits, read_recent
from decoder_client.client.prior_follow import PriorFollower
from decoder_client.client.session import TopkAt, TopkRows
from indexer.drafter import DrafterConfig, NamespaceDrafter
from indexer.lifetime_index import LifetimeConfig
from indexer.prior import StaticPrior
from indexer.session import Session
from indexer.tokens import Namespace, as_tokens
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)

NEAR_MEMORY_TOKENS = 1 << 22  # the near copy's lifetime memory: the requests this process finished
# At most this long at start reading the fleet's recent history from the service's log.
START_S = 10.0
# Followed tokens that join the memory at one draft call at most (a backlog after an outage
# joins over several calls: each new run of the memory is sorted on the drafting thread).
TAKE_TOKENS = 1 << 16
COMMIT_POLL_S = 0.05  # how often the committing thread books commits under way


class NearSession:
    """One request drafted for by a near copy: its session there."""

    __slots__ = ("local",)

    def __init__(self, local: Session) -> None:
        self.local = local

    def __len__(self) -> int:
        return len(self.local.context)


class NearClient:
    """Drafts from a near copy of ``config.namespace`` (``vocab_size`` ids) in this process, and
    commits finished requests to the service at ``config.target``; see the module docstring.
    ``prior``: the namespace's static prior (None: none); ``memory_tokens``: the size of the
    near copy's lifetime memory; ``commit``: also commit to the service (False: nothing is sent
    anywhere, a decoder on its own); ``follow_s``: how often the service's log is read for other
    processes' commits (0: never); ``start_s``: the most time spent at start reading the log's
    recent history and the service's prior (0: the near copy starts empty); ``prior_check_s``:
    without ``prior``, how often the service is asked for its prior of the namespace, a newer
    version than the one held (0: never; see :mod:`~decoder_client.client.prior_follow`).

    ``vocab_size`` is stated to the service (``config.vocab_size`` is set to it): a namespace
    of another vocabulary is refused, and the near copy then neither follows its log and prior
    nor commits to it, drafting from its own requests alone."""

    def __init__(
        self,
        config: ClientConfig,
        vocab_size: int,
        prior: StaticPrior | None = None,
        *,
        memory_tokens: int = NEAR_MEMORY_TOKENS,
        commit: bool = True,
        follow_s: float = FOLLOW_S,
        start_s: float = START_S,
        prior_check_s: float = 0.0,
    ) -> None:
        if config.lookahead:
            raise ValueError("a near copy drafts at each step and never ahead: lookahead must be 0")
        if follow_s < 0:
            raise ValueError(f"follow_s must be >= 0 (0: the service's log is not followed), got {follow_s}")
        if start_s < 0:
            raise ValueError(f"start_s must be >= 0 (0: the near copy starts empty), got {start_s}")
        if prior_check_s < 0:
            raise ValueError(f"prior_check_s must be >= 0 (0: the service's prior is never read), got {prior_check_s}")
        if config.vocab_size not in (0, vocab_size):
            raise ValueError(f"config.vocab_size {config.vocab_size} is not the near copy's vocab_size {vocab_size}")
        config = dataclasses.replace(config, vocab_size=vocab_size)
        self._config = config
        self._params = config.params
        self.drafter = NamespaceDrafter(
            Namespace(name=config.namespace, vocab_size=vocab_size),
            DrafterConfig(lifetime=LifetimeConfig(capacity_tokens=memory_tokens)),
            prior,
        )
        self.stats = ClientStats()
        self._rebuilding: threading.Thread | None = None
        # The service's client: touched under the lock only, by close and by a thread of its own
        # that carries the commits through (a decoder may never call again once it is done).
        self._remote = None
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stopping = threading.Event()
        self._committer: threading.Thread | None = None
        self._own = OwnCommits()
        self._follower: LogFollower | None = None
        self.prior_follower: PriorFollower | None = None
        self._rebuild_lock = threading.Lock()
        if commit:
            from decoder_client.client.sync import DraftClient

            started = time.monotonic()
            self._remote = DraftClient(config)
            self._committer = threading.Thread(target=self._commit_loop, name="draftcache-near-commits", daemon=True)
            self._committer.start()
            if prior is None and prior_check_s:  # read beside the log's history, below
                self.prior_follower = PriorFollower(self._remote.read_prior, self._set_prior, every_s=prior_check_s)
                self.prior_follower.start()
            after = self._start_from_log(memory_tokens, start_s) if follow_s and start_s else ""
            if follow_s and after is not None:
                # The read touches only the client's stub (thread-safe), never what the lock guards.
                self._follower = LogFollower(
                    self._remote.read_log, self._own, every_s=follow_s, max_pending=memory_tokens, after=after
                )
                self._follower.start()
            if self.prior_follower is not None and start_s:  # the first requests draft with it
                self.prior_follower.loaded.wait(max(0.0, start_s - (time.monotonic() - started)))

    def _set_prior(self, prior: StaticPrior, version: int) -> None:
        """A version of the namespace's prior read from the service: drafts take it from their
        next call (one reference swap, as the service swaps its own). ``ValueError`` (nothing
        swapped) when it holds ids outside the namespace's vocabulary."""
        prior.check_vocab(self.drafter.namespace.vocab_size)
        self.drafter.prior = prior
        self.stats.prior_version = version

    def _start_from_log(self, memory_tokens: int, seconds: float) -> str | None:
        """The fleet's recent history, read from the service's log (its newest entries, as many
        tokens as the memory holds, for at most ``seconds``), indexed before the first request;
        the id following goes on after ("": nothing read, it follows from the log's end; None:
        the service refuses the log to this near copy, which does not follow it)."""
        assert self._remote is not None
        started = time.monotonic()
        try:
            entries, after = read_recent(self._remote.read_log, memory_tokens, seconds)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:  # another vocabulary: it stays so
                logger.error("near copy: the service refuses its log (%s); it is not followed", exc.details())
                return None
            logger.warning("near copy: the service's log could not be read (%s); it starts empty", exc.code())
            return ""
        entries = self._in_vocabulary(entries)
        if entries:
            self.drafter.commit_finished(entries)
            self.drafter.memory.rebuild()
            self.stats.followed += len(entries)
        logger.info(
            "near copy: %d requests (%d tokens) of the fleet's history in %.1f s",
            len(entries), sum(e.size for e in entries), time.monotonic() - started,
        )  # fmt: skip
        return after

    @property
    def config(self) -> ClientConfig:
        return self._config

    def cut_chains_at(self, min_prob: float) -> None:
        """Chains end before a token less likely than ``min_prob`` to be reached (from the next draft on)."""
        if min_prob != self._params.chain_min_prob:
            self._params = dataclasses.replace(self._params, chain_min_prob=min_prob)

    def open(
        self, prompts: Sequence[Sequence[int] | np.ndarray], *, wait: bool = True, wait_s: float = 0.0
    ) -> list[NearSession]:
        """A session per prompt (``wait`` and ``wait_s`` are the draft client's: a near copy
        opens at once). Every prompt is checked before any is opened."""
        checked = [self._ids(p, "prompt") for p in prompts]
        return [NearSession(self.drafter.open_checked(tokens)) for tokens in checked]

    def draft(
        self,
        sessions: Sequence[NearSession],
        new_tokens: Sequence[Sequence[int]],
        topk: Sequence[TopkRows | None] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> list[DraftTree]:
        """Append each session's new tokens, then one tree (a chain in chain mode) per session,
        in one compiled step; ``deadline_s`` is the draft client's (nothing here waits)."""
        self.add_tokens(sessions, new_tokens, topk)
        self._take_followed()
        trees = self.drafter.draft_many([(s.local, self._params) for s in sessions])
        self.stats.near += len(sessions)
        return list(trees)

    def add_tokens(
        self,
        sessions: Sequence[NearSession],
        new_tokens: Sequence[Sequence[int]],
        topk: Sequence[TopkRows | None] | None = None,
    ) -> None:
        """Tokens the target produced since each session's last draft (checked, all of them
        before any session takes its own), with the target's top-k where they were verified."""
        if len(new_tokens) != len(sessions) or (topk is not None and len(topk) != len(sessions)):
            raise ValueError(f"{len(sessions)} sessions, {len(new_tokens)} token lists, top-k for {len(topk or ())}")
        news = [self._ids(new, "new tokens") for new in new_tokens]
        rows = [None] * len(sessions) if topk is None else topk
        for s, new, top in zip(sessions, news, rows, strict=True):
            if isinstance(top, TopkAt):  # checked there, dtype included
                self.drafter.observe_followers(self._ids(top.after, "top-k positions"), np.asarray(top.rows))
            elif top is not None and new.size:
                self.drafter.observe_topk(s.local, new, np.asarray(top))
        self.drafter.accept_many([(s.local, new, None) for s, new in zip(sessions, news, strict=True) if new.size])

    def _ids(self, tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        """``tokens`` checked against the namespace (an integer array of any width is taken, as
        the draft client takes it)."""
        if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu" and tokens.dtype != np.int32:
            tokens = tokens.tolist()
        return as_tokens(tokens, self.drafter.namespace.vocab_size, what=what)

    def close(self, sessions: Sequence[NearSession], *, commit: bool = True) -> None:
        """End the requests; with ``commit`` their tokens join the near copy's lifetime memory
        and go to the service's (in the background)."""
        if not sessions:
            return
        if not commit:
            for s in sessions:
                self.drafter.release(s.local)
            return
        self.drafter.close_many([(s.local, 0) for s in sessions])
        if self._remote is not None:
            for s in sessions:  # told apart in the service's log when it is followed
                self._own.add(s.local.context.tokens)
            with self._lock:
                self._remote.commit([s.local.context.tokens for s in sessions])
                self._sync_stats()
            self._work.set()
        if self.drafter.memory.needs_rebuild():
            self._rebuild()

    def settle(self) -> None:
        """Carry on with the commits the service has not taken yet, and index the requests
        finished since the near copy's last rebuild (a decoder calls it while it rests)."""
        if self._remote is not None:
            with self._lock:
                self._remote.settle()
                self._sync_stats()
        self._take_followed()
        if self.drafter.memory.delta_tokens():
            self._rebuild()

    def _in_vocabulary(self, entries: list[np.ndarray]) -> list[np.ndarray]:
        """The log's entries whose ids all lie in the namespace's vocabulary: one that does not
        (a service of another tokenizer, a damaged log) is left out, never drafted from."""
        vocab = self.drafter.namespace.vocab_size
        kept = [e for e in entries if not e.size or (int(e.min()) >= 0 and int(e.max()) < vocab)]
        if len(kept) < len(entries):
            dropped = len(entries) - len(kept)
            logger.warning("near copy: %d log entries with ids outside the vocabulary not used", dropped)
        return kept

    def _take_followed(self) -> None:
        """Other processes' commits read from the service's log join the lifetime memory (on
        the drafting thread: the memory changes only there)."""
        if self._follower is None:
            return
        followed = self._in_vocabulary(self._follower.take(TAKE_TOKENS))
        if followed:
            self.drafter.commit_finished(followed)
            self.stats.followed += len(followed)
            if self.drafter.memory.needs_rebuild():
                self._rebuild()

    def _commit_loop(self) -> None:
        """While commits are under way or kept, book them and send the next (see
        :meth:`DraftClient.settle`); otherwise wait for a close."""
        assert self._remote is not None
        while True:
            self._work.wait()
            if self._stopping.is_set():
                return
            self._work.clear()
            try:
                with self._lock:
                    self._remote.settle()
                    self._sync_stats()
                    pending = self.stats.commits_pending
            except Exception:  # the thread carries on: a commit is retried, never dropped for this
                logger.exception("near copy: committing to the service failed")
                pending = 1
            if pending:
                self._work.set()
                self._stopping.wait(COMMIT_POLL_S)

    def _rebuild(self) -> None:
        """Rebuild the lifetime indexes on a thread of their own (drafting goes on meanwhile
        over the old ones and the delta; the swap is atomic)."""
        with self._rebuild_lock:  # a close and an idle engine's settle may ask at once
            if self._rebuilding is not None and self._rebuilding.is_alive():
                return
            self._rebuilding = threading.Thread(target=self.drafter.memory.rebuild, name="draftcache-near-rebuild")
            self._rebuilding.daemon = True
            self._rebuilding.start()

    def _sync_stats(self) -> None:
        if self._remote is not None:
            remote = self._remote.stats
            self.stats.commits_retried, self.stats.commits_dropped = remote.commits_retried, remote.commits_dropped
            self.stats.commits_pending = remote.commits_pending
            self.stats.failures = remote.failures

    def shutdown(self) -> None:
        """Commit what the service has not taken yet (one try each), and close its channel."""
        if self._rebuilding is not None:
            self._rebuilding.join()
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._follower is not None:
            self._follower.stop()
        if self.prior_follower is not None:
            self.prior_follower.stop(0)  # a read under way ends with the channel
        self._work.set()
        if self._committer is not None:
            self._committer.join()
        if self._remote is not None:
            with self._lock:
                self._remote.shutdown()
                self._sync_stats()

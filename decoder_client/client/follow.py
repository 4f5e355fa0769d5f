"""Following the service's lifetime log: what other processes committed, for a near copy.

A near copy (:mod:`decoder_client.client.near`) drafts from the requests its own process
finished; the fleet's other replicas commit theirs to the service. A :class:`LogFollower` reads
the service's log now and then, on a thread of its own, from where the log stood when it
started, and hands over every entry that is not one of this process's own commits
(:class:`OwnCommits`): those are in the near copy already. Nothing here waits on a step's path:
the drafter's thread takes what was read (:meth:`LogFollower.take`) when it next drafts.

>>> own = OwnCommits()
>>> own.add(np.arange(40, dtype=np.int32))
>>> own.claims(np.arange(10, 40, dtype=np.int32))  # the service logged only its new part
True
>>> own.claims(np.arange(10, 40, dtype=np.int32))  # ... once
False
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

logger = logging.getLogger(__name__)

FOLLOW_S = 1.0  # how often the log is read
READ_TOKENS = 1 << 16  # tokens one read asks for at most (a backlog is read in several, back to back)
TAIL = 16  # tokens at a request's end that tell one of this process's commits in the log
OWN_KEEP = 4096  # this process's latest commits remembered until seen in the log

LogRead = Callable[[str, int], tuple[list[tuple[str, np.ndarray]], str]]  # (after, max_tokens) -> (entries, last)


def _tail(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(tokens[-TAIL:], dtype=np.int32).tobytes(), digest_size=16).digest()


class OwnCommits:
    """The requests this process committed lately, to tell them in the service's log, where each
    appears whole or as its end only (the service leaves out a start it holds already). An entry
    shorter than :data:`TAIL` tokens is never claimed (it is added again: harmless)."""

    def __init__(self, keep: int = OWN_KEEP) -> None:
        self._keep = keep
        self._by_tail: collections.OrderedDict[bytes, list[np.ndarray]] = collections.OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def add(self, tokens: np.ndarray) -> None:
        if tokens.size < TAIL:
            return
        with self._lock:
            self._by_tail.setdefault(_tail(tokens), []).append(np.array(tokens, dtype=np.int32))
            self._count += 1
            while self._count > self._keep:  # the oldest, never seen in the log (a dropped commit)
                _, dropped = self._by_tail.popitem(last=False)
                self._count -= len(dropped)

    def claims(self, entry: np.ndarray) -> bool:
        """Whether ``entry`` is one of this process's commits (its end); it is forgotten then."""
        if entry.size < TAIL:
            return False
        key = _tail(entry)
        with self._lock:
            mine = self._by_tail.get(key, [])
            for i, tokens in enumerate(mine):
                if tokens.size >= entry.size and np.array_equal(tokens[tokens.size - entry.size :], entry):
                    del mine[i]
                    self._count -= 1
                    if not mine:
                        del self._by_tail[key]
                    return True
        return False


def read_recent(read: LogRead, max_tokens: int, seconds: float) -> tuple[list[np.ndarray], str]:
    """The log's most recent entries, of at most ``max_tokens`` tokens in all, read from its
    start for at most ``seconds`` (the rest is left to following): oldest first, and the id
    reading goes on after. Raises what ``read`` raises.

    >>> log = [(f"1-{i}", np.arange(i, i + 3, dtype=np.int32)) for i in range(5)]
    >>> def read(after, n):  # as the service answers: entries of up to n tokens after ``after``
    ...     at = 0 if after == "0" else int(after.split("-")[1]) + 1
    ...     part = log[at : at + n // 3]
    ...     return part, part[-1][0] if part else after
    >>> entries, after = read_recent(read, 7, 10.0)
    >>> [e.tolist() for e in entries], after  # 15 tokens in the log, the newest 7 or fewer kept
    ([[3, 4, 5], [4, 5, 6]], '1-4')
    """
    kept: collections.deque[np.ndarray] = collections.deque()
    held, after = 0, "0"
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        entries, last = read(after, READ_TOKENS)
        after = last or after
        for _, tokens in entries:
            kept.append(tokens)
            held += tokens.size
        while held > max_tokens and kept:
            held -= kept.popleft().size
        if not entries:  # the log's end (a page stops short of the entry that would overflow it)
            break
    return list(kept), after


class LogFollower:
    """Reads the log through ``read`` every ``every_s`` seconds on a thread of its own, after
    the entry ``after`` (empty: from the log's end when the first read lands); keeps the entries
    ``own`` does not claim, at most ``max_pending`` tokens of them (the oldest go first), until
    :meth:`take`."""

    def __init__(
        self,
        read: LogRead,
        own: OwnCommits,
        *,
        every_s: float = FOLLOW_S,
        max_pending: int = 1 << 22,
        after: str = "",
    ) -> None:
        if every_s <= 0 or max_pending < 1:
            raise ValueError("every_s must be > 0 and max_pending >= 1")
        self._read, self._own, self._every_s, self._max_pending = read, own, every_s, max_pending
        self._after = after  # the last entry read; empty: the first read asks where the log ends
        self._pending: collections.deque[np.ndarray] = collections.deque()
        self._pending_tokens = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.followed = 0  # entries handed over
        self.own = 0  # entries that were this process's commits
        self.failures = 0  # reads that failed (retried at the next turn)
        self._thread = threading.Thread(target=self._loop, name="draftcache-follow", daemon=True)

    def start(self) -> LogFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def take(self, max_tokens: int | None = None) -> list[np.ndarray]:
        """The entries read and not taken yet, oldest first: all of them, or as many as fit
        ``max_tokens`` (at least one), the rest left for the next call."""
        with self._lock:
            out: list[np.ndarray] = []
            taken = 0
            while self._pending and (max_tokens is None or not out or taken + self._pending[0].size <= max_tokens):
                out.append(self._pending.popleft())
                taken += out[-1].size
            self._pending_tokens -= taken
        return out

    def read_once(self) -> bool:
        """One read; whether it came back at least half full (then the log holds more: read
        again at once. A page stops short of the entry that would overflow it, so a full one is
        rarely exactly full; one that is less than half full waits for the next turn, as a
        stream of small commits should). Raises what the read raises."""
        entries, last = self._read(self._after, READ_TOKENS)
        self._after = last or self._after
        theirs = []
        for _, tokens in entries:
            if self._own.claims(tokens):
                self.own += 1
            else:
                theirs.append(tokens)
        with self._lock:
            for tokens in theirs:
                self._pending.append(tokens)
                self._pending_tokens += tokens.size
            while self._pending_tokens > self._max_pending and len(self._pending) > 1:
                self._pending_tokens -= self._pending.popleft().size
            self.followed += len(theirs)
        return 2 * sum(t.size for _, t in entries) >= READ_TOKENS

    def _loop(self) -> None:
        wait = 0.0  # the first read at once: it fixes where following starts
        while not self._stopping.wait(wait):
            wait = self._every_s
            try:
                if self.read_once():
                    wait = 0.0
            except grpc.RpcError as exc:
                self.failures += 1
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:  # a service that predates the log read
                    logger.warning("draftcache: the service does not serve its log; the near copy will not follow it")
                    return
                if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:  # another vocabulary: it stays so
                    why = exc.details()
                    logger.error("draftcache: the service refuses its log (%s); the near copy will not follow it", why)
                    return
                logger.debug("draftcache: reading the service's log failed (%s); again in %.1f s", exc.code(), wait)
            except Exception:  # the thread carries on: a read that failed is made again
                self.failures += 1
                logger.exception("draftcache: following the service's log failed")

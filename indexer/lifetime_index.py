"""Everything a namespace drafts from across requests: the lifetime buffer, its rebuilt indexes
(suffix array + frozen n-gram table), small delta indexes over requests finished since the
last rebuild, and the exact-prompt cache.

The delta is log-structured, so a finished request costs about its own size to index rather than
the whole delta's: each request starts a run of its own, and the newest two runs merge (one
suffix array over both) while the older is at most twice the newer. Runs double in size going
back, so there are O(log delta) of them and each token is re-indexed O(log delta) times.

Rebuilds read a snapshot and swap the finished indexes in with one reference assignment, so
readers never see a half-built index and never wait for a rebuild. A rebuild extends the last
generation rather than sorting the whole buffer again (:func:`next_indexes`): the suffix array
takes the requests finished since (the ring's overwritten head dropped) by a merge that costs
about their size times a logarithm, not the buffer's size, and the frozen n-gram table, a
frequency summary that a few more requests barely move, is rebuilt only once a set share of
the buffer is new since it was. So rebuilds stay cheap however full the buffer is, and can run
often enough to keep the delta small.

Several processes can share one set of indexes instead of each building its own: a memory made
with ``ring=False`` keeps no buffer and never rebuilds; it adopts indexes built elsewhere over a
prefix of a shared log (everything up to a log position) and keeps as its delta only what that
prefix does not cover. Requests carry their log position once it is known (:meth:`mark_logged`
for a process's own commits), so coverage is decided by position, not by arrival order, which
differs from process to process.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from indexer import kernels
from indexer.lifetime_buffer import LifetimeBuffer
from indexer.ngram_table import NgramTable, NgramTableConfig, lcp_array, with_final_separator
from indexer.suffix_array import SuffixIndex, build_suffix_array, extend_suffix_array
from indexer.tokens import SEPARATOR

# Suffix arrays hold int32 positions: the most tokens one index may cover.
MAX_CAPACITY_TOKENS = int(np.iinfo(np.int32).max)


@dataclass(frozen=True, kw_only=True)
class LifetimeConfig:
    """Sizes of one namespace's lifetime memory."""

    capacity_tokens: int = 16 << 20
    table: NgramTableConfig = field(default_factory=NgramTableConfig)
    delta_max_tokens: int = 1 << 16  # past this, finished requests call for a rebuild
    # The n-gram table is rebuilt once this share of the indexed tokens is new since it was
    # built (0: at every rebuild); in between, rebuilds carry it over.
    table_refresh: float = 0.25
    exact_entries: int = 4096
    exact_max_tokens: int = 1 << 14  # longest response kept for exact-prompt hits

    def __post_init__(self) -> None:
        if not 2 <= self.capacity_tokens <= MAX_CAPACITY_TOKENS:
            raise ValueError(f"capacity_tokens must be in [2, {MAX_CAPACITY_TOKENS}], got {self.capacity_tokens}")
        if self.delta_max_tokens < 1:
            raise ValueError(f"delta_max_tokens must be >= 1, got {self.delta_max_tokens}")
        if not 0 <= self.table_refresh <= 1:
            raise ValueError(f"table_refresh must be in [0, 1], got {self.table_refresh}")
        if self.exact_entries < 0 or self.exact_max_tokens < 0:
            raise ValueError("exact_entries and exact_max_tokens must be >= 0")


_SERIALS = itertools.count(1)


@dataclass(frozen=True)
class LifetimeIndexes:
    """One immutable generation of rebuilt indexes."""

    suffix: SuffixIndex
    table: NgramTable
    version: int  # buffer.appended when the snapshot was taken
    build_seconds: float
    table_version: int | None = None  # the version its table was built at (None: this one)
    extended: bool = False  # its suffix array extended the last generation's (not sorted afresh)
    # Its suffix array ranks separators apart (every array this package sorts; a generation
    # saved by an older release may not), so the next generation can extend it.
    extendable: bool = True
    # Tells this generation from every other one in the process (a match found in one is
    # carried to the next search only while the same generation serves).
    serial: int = field(default_factory=lambda: next(_SERIALS), compare=False)

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes + self.table.nbytes

    @property
    def table_built_at(self) -> int:
        return self.version if self.table_version is None else self.table_version


def build_indexes(tokens: np.ndarray, table_config: NgramTableConfig, version: int) -> LifetimeIndexes:
    """Suffix array and n-gram table over one snapshot, sorted afresh (pure; run off the hot
    path)."""
    start = time.perf_counter()
    tokens = with_final_separator(tokens)  # an empty buffer indexes as one separator
    sa = build_suffix_array(tokens)
    table = build_table(tokens, sa, table_config)
    suffix = SuffixIndex(tokens, sa)
    return LifetimeIndexes(suffix, table, version, time.perf_counter() - start)


def build_table(tokens: np.ndarray, sa: np.ndarray, config: NgramTableConfig) -> NgramTable:
    """The frozen n-gram table over ``tokens`` from their suffix array (its LCP computed here)."""
    return NgramTable.build_from_suffix_array(tokens, sa, lcp_array(tokens, sa), config)


def next_indexes(
    previous: LifetimeIndexes | None, tokens: np.ndarray, new: int, config: LifetimeConfig, version: int
) -> LifetimeIndexes:
    """The generation after ``previous`` over ``tokens``: ``previous``'s tokens less a head (the
    ring's overwritten part), then ``new`` tokens of requests finished since, each ending with a
    separator (pure; run off the hot path).

    Its suffix array extends ``previous``'s when the kept part is exactly ``previous``'s tail
    (:func:`~indexer.suffix_array.extend_suffix_array`), else is sorted afresh; either way it is
    the array :func:`build_indexes` would make. The table is carried over until
    ``config.table_refresh`` of the tokens are new since it was built.

    >>> S = int(SEPARATOR)
    >>> first = next_indexes(None, np.array([1, 2, S], np.int32), 3, LifetimeConfig(), 3)
    >>> second = next_indexes(first, np.array([1, 2, S, 1, 3, S], np.int32), 3, LifetimeConfig(), 6)
    >>> second.extended, second.table_built_at  # half the tokens are new: the table is due
    (True, 6)
    """
    start = time.perf_counter()
    tokens = with_final_separator(np.ascontiguousarray(tokens, dtype=np.int32))
    kept = tokens.size - new
    sa = None
    if previous is not None and previous.extendable and new > 0 and 0 < kept <= previous.suffix.size:
        dropped = previous.suffix.size - kept
        if np.array_equal(tokens[:kept], previous.suffix.tokens[dropped:]):
            sa = extend_suffix_array(tokens, previous.suffix.suffix_array, dropped, new)
    extended = sa is not None
    if sa is None:
        sa = build_suffix_array(tokens)
    if previous is not None and version - previous.table_built_at < config.table_refresh * tokens.size:
        table, table_version = previous.table, previous.table_built_at
    else:
        table, table_version = build_table(tokens, sa, config.table), None
    seconds = time.perf_counter() - start
    return LifetimeIndexes(SuffixIndex(tokens, sa), table, version, seconds, table_version, extended)


@dataclass(frozen=True)
class StackedRuns:
    """Suffix indexes laid end to end (index ``i``: tokens and suffix array rows
    ``[offsets[i], offsets[i + 1])``), so one compiled search covers them all."""

    tokens: np.ndarray
    suffix_array: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, indexes: Sequence[SuffixIndex]) -> StackedRuns:
        offsets = np.zeros(len(indexes) + 1, dtype=np.int64)
        np.cumsum([i.size for i in indexes], out=offsets[1:])
        if not indexes:
            return cls(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), offsets)
        return cls(
            np.concatenate([i.tokens for i in indexes]), np.concatenate([i.suffix_array for i in indexes]), offsets
        )


_NO_INDEX = StackedRuns.of([])
_NO_TABLE = (
    np.zeros(0, dtype=np.uint64),
    np.zeros(1, dtype=np.int64),
    np.zeros((0, 1), dtype=np.int32),
    np.zeros((0, 1), dtype=np.uint16),
)
LogId = tuple[int, int]  # a position in the shared log, ordered as the log orders its entries
Run = tuple[list[np.ndarray], SuffixIndex]  # a delta run: its requests (with separators), their index


class Served(NamedTuple):
    """What a memory's searches read: the main indexes and the delta runs beside them, swapped
    in together (one reference) so that no search sees a new main index beside the runs it
    replaced, which would count their requests twice, nor the old one beside their trimmed
    runs, which would miss them."""

    indexes: LifetimeIndexes | None
    runs: list[Run]  # oldest first
    stacked: StackedRuns  # the runs' indexes end to end, for drafting


def next_generation(previous: np.ndarray | None, requests: list[np.ndarray], capacity: int) -> np.ndarray:
    """The tokens a new generation indexes: the previous generation's tokens (ending with a
    separator), then each new request followed by a separator, cut to the last ``capacity``
    tokens as the ring buffer would hold them.

    >>> S = int(SEPARATOR)
    >>> next_generation(None, [np.array([1, 2], np.int32)], 8).tolist() == [1, 2, S]
    True
    >>> next_generation(np.array([1, 2, S], np.int32), [np.array([3, 4, 5], np.int32)], 5).tolist() == [S, 3, 4, 5, S]
    True
    """
    if capacity < 2:
        raise ValueError(f"capacity must be >= 2, got {capacity}")
    sep = np.array([SEPARATOR], dtype=np.int32)
    parts = [] if previous is None or previous.size == 0 else [np.asarray(previous, dtype=np.int32)]
    if parts and parts[0][-1] != SEPARATOR:
        raise ValueError("a generation's tokens end with a separator")
    for tokens in requests:
        parts.extend((np.asarray(tokens[-(capacity - 1) :], dtype=np.int32), sep))
    if not parts:
        return np.zeros(0, dtype=np.int32)
    joined = np.concatenate(parts)
    return joined[-capacity:].copy() if joined.size > capacity else joined


def appended_tokens(requests: list[np.ndarray], capacity: int) -> int:
    """How many tokens :func:`next_generation` appends for ``requests`` (each cut to its last
    ``capacity - 1`` tokens, then a separator), before the cut to ``capacity``.

    >>> appended_tokens([np.array([1, 2], np.int32), np.array([3, 4, 5], np.int32)], 3)
    6
    """
    return int(sum(min(r.size, capacity - 1) + 1 for r in requests))


class SearchArrays(NamedTuple):
    """What a compiled draft step searches in the lifetime memory: the main suffix index and
    the delta runs stacked end to end (see :func:`~indexer.kernels.search.stacked_continuations`),
    and the frozen table over the main index (see
    :meth:`~indexer.ngram_table.NgramTable.search_arrays`; ``table_leader_len`` 0: none)."""

    main_tokens: np.ndarray
    main_sa: np.ndarray
    run_tokens: np.ndarray
    run_sa: np.ndarray
    run_offsets: np.ndarray
    table_keys: np.ndarray
    table_offsets: np.ndarray
    table_followers: np.ndarray
    table_probs: np.ndarray
    table_leader_len: int
    main_serial: int  # the main index's generation (0: none)


def search_arrays(indexes: LifetimeIndexes | None, runs: StackedRuns = _NO_INDEX) -> SearchArrays:
    """:meth:`LifetimeMemory.search_arrays` for given main indexes and delta runs."""
    if indexes is None:
        main, table, ll, serial = (_NO_INDEX.tokens, _NO_INDEX.suffix_array), _NO_TABLE, 0, 0
    else:
        main = (indexes.suffix.tokens, indexes.suffix.suffix_array)
        table, ll, serial = indexes.table.search_arrays(), indexes.table.config.leader_len, indexes.serial
    return SearchArrays(*main, runs.tokens, runs.suffix_array, runs.offsets, *table, ll, serial)


def _occurs(index: SuffixIndex, pattern: np.ndarray) -> bool:
    first, last = index.match_range(pattern)
    return last > first


def prompt_key(prompt: np.ndarray) -> bytes:
    return hashlib.blake2b(prompt.tobytes(), digest_size=16).digest()


class LifetimeMemory:
    """A namespace's cross-request memory.

    >>> mem = LifetimeMemory(LifetimeConfig(capacity_tokens=64))
    >>> mem.commit(np.array([1, 2, 3, 4], dtype=np.int32))
    >>> [idx.longest_match(np.array([9, 2, 3], dtype=np.int32), max_len=4)[0] for idx in mem.suffix_indexes()]
    [2]

    ``ring=False``: no buffer of its own; the main indexes come from :meth:`adopt`.
    """

    def __init__(self, config: LifetimeConfig, *, ring: bool = True) -> None:
        self.config = config
        self.buffer: LifetimeBuffer | None = LifetimeBuffer(config.capacity_tokens) if ring else None
        self._indexes: LifetimeIndexes | None = None
        self._runs: list[Run] = []  # oldest first
        self._served = Served(None, [], _NO_INDEX)
        self._delta_tokens: list[np.ndarray] = []
        self._delta_ids: list[LogId | None] = []  # each delta piece's log position, once known
        self._delta_from = 0  # buffer.appended covered by the main indexes
        self._requests = 0
        self._exact: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._rebuild_lock = threading.Lock()

    @property
    def indexes(self) -> LifetimeIndexes | None:
        return self._indexes

    @property
    def capacity(self) -> int:
        return self.config.capacity_tokens

    @property
    def requests(self) -> int:
        """Requests added to this memory since it was made."""
        return self._requests

    @property
    def buffered_tokens(self) -> int:
        """Tokens the memory holds (separators included), at most ``capacity``."""
        if self.buffer is not None:
            return self.buffer.size
        main = 0 if self._indexes is None else self._indexes.suffix.size
        return min(self.capacity, main + self.delta_tokens())

    def commit(
        self, tokens: np.ndarray, *, prompt: np.ndarray | None = None, response: np.ndarray | None = None
    ) -> None:
        """Add one finished request's tokens; remember ``prompt -> response`` for exact hits."""
        exact = [(prompt, response)] if prompt is not None and response is not None else None
        self.commit_many([tokens], exact=exact)

    def commit_many(
        self,
        requests: list[np.ndarray],
        log_ids: list[LogId] | None = None,
        *,
        exact: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        """Bulk-add finished requests (several closing at once, a restore, a load): one delta
        run, not one each. ``log_ids``: their positions in the shared log, when they came from
        it; ``exact``: each one's ``(prompt, response)`` for exact hits, as in :meth:`commit`."""
        if log_ids is not None and len(log_ids) != len(requests):
            raise ValueError("one log id per request")
        if exact is not None and len(exact) != len(requests):
            raise ValueError("one (prompt, response) pair per request")
        with self._lock:
            if requests:
                ids = log_ids if log_ids is not None else [None] * len(requests)
                self._add_run([self._append(tokens, i) for tokens, i in zip(requests, ids, strict=True)])
            for prompt, response in exact or ():
                self._remember(prompt, response)

    def mark_logged(self, tokens: np.ndarray, log_id: LogId) -> bool:
        """Record the log position of a request this process committed (the newest one with
        these tokens and no position yet). False when no such request is in the delta."""
        kept = self._kept(tokens)
        with self._lock:
            for i in range(len(self._delta_tokens) - 1, -1, -1):
                piece = self._delta_tokens[i]
                if self._delta_ids[i] is None and piece.size == kept.size + 1 and np.array_equal(piece[:-1], kept):
                    self._delta_ids[i] = log_id
                    return True
        return False

    def adopt(self, indexes: LifetimeIndexes, through: LogId) -> None:
        """Serve ``indexes`` (built elsewhere over the shared log up to ``through``) as the main
        indexes; the delta keeps only requests after ``through`` or not yet logged."""
        if self.buffer is not None:
            raise RuntimeError("a memory with its own ring buffer rebuilds its indexes itself")
        with self._lock:
            pairs = zip(self._delta_tokens, self._delta_ids, strict=True)
            kept = [(p, i) for p, i in pairs if i is None or i > through]
            self._delta_tokens = [p for p, _ in kept]
            self._delta_ids = [i for _, i in kept]
            self._indexes = indexes
            self._refresh_delta()

    def _kept(self, tokens: np.ndarray) -> np.ndarray:
        """What the memory keeps of one request: at most capacity - 1 tokens (its tail)."""
        cap = self.capacity
        return tokens[-(cap - 1) :] if tokens.size >= cap else tokens

    def _append(self, tokens: np.ndarray, log_id: LogId | None) -> np.ndarray:
        """Into the ring (if any); returns the request as the delta holds it (with its
        separator). The ring keeps at most capacity - 1 tokens of one request (plus its
        separator); the delta mirrors exactly what the ring holds so a rebuild trims it exactly."""
        kept = self._kept(tokens)
        if self.buffer is not None:
            self.buffer.append(kept)
        piece = np.concatenate((kept, np.array([SEPARATOR], dtype=np.int32)))
        self._delta_tokens.append(piece)
        self._delta_ids.append(log_id)
        self._requests += 1
        return piece

    def _add_run(self, pieces: list[np.ndarray]) -> None:
        runs: list[Run] = [*self._runs, (pieces, SuffixIndex(np.concatenate(pieces)))]  # readers keep the old list
        while len(runs) >= 2 and runs[-2][1].size <= 2 * runs[-1][1].size:
            newer, older = runs.pop(), runs.pop()
            joined = older[0] + newer[0]
            runs.append((joined, SuffixIndex(np.concatenate(joined))))
        self._set_runs(runs)
        if sum(run.size for _, run in runs) > self.capacity:
            self._refresh_delta()  # the ring overwrote part of the delta: only a tiny ring does

    def _set_runs(self, runs: list[Run]) -> None:
        """The delta's runs, served with the main indexes as they stand now."""
        self._runs = runs
        self._served = Served(self._indexes, runs, StackedRuns.of([run for _, run in runs]))

    def _refresh_delta(self) -> None:
        """One run over the whole delta, cut to what the ring still holds (without a ring, the
        oldest requests past the capacity leave the delta)."""
        if self.buffer is None:
            total = sum(p.size for p in self._delta_tokens)
            while len(self._delta_tokens) > 1 and total - self._delta_tokens[0].size >= self.capacity:
                total -= self._delta_tokens.pop(0).size
                self._delta_ids.pop(0)
        if not self._delta_tokens:
            self._set_runs([])
            return
        joined = np.concatenate(self._delta_tokens)[-self.capacity :]
        self._set_runs([([joined], SuffixIndex(joined))])

    def _remember(self, prompt: np.ndarray, response: np.ndarray) -> None:
        if self.config.exact_entries == 0 or response.size == 0:
            return
        key = prompt_key(prompt)
        self._exact[key] = response[: self.config.exact_max_tokens].copy()
        self._exact.move_to_end(key)
        while len(self._exact) > self.config.exact_entries:
            self._exact.popitem(last=False)

    def exact_response(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            return self._exact.get(key)

    def suffix_indexes(self) -> list[SuffixIndex]:
        """The indexes to search, main first; together they cover the whole buffer."""
        served = self._served
        out = [] if served.indexes is None else [served.indexes.suffix]
        out.extend(run for _, run in served.runs)
        return out

    def continuations(
        self, context: np.ndarray, *, max_len: int, depth: int, samples: int, hint: int = 0
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """The longest match of the context's suffix over every index (``n``, 0 if none) and up
        to about ``samples`` continuations of ``depth`` tokens after it, as ``(n, rows,
        weights)``: a row stands for ``weight`` occurrences. The indexes holding the match share
        the samples by how often each does. ``hint`` (the previous match plus the tokens
        accepted since) only saves work."""
        indexes, _, runs = self._served
        main = _NO_INDEX if indexes is None else indexes.suffix
        n, rows, weights, _ = kernels.stacked_continuations(
            main.tokens,
            main.suffix_array,
            runs.tokens,
            runs.suffix_array,
            runs.offsets,
            context,
            max_len,
            hint,
            depth,
            samples,
            int(SEPARATOR),
        )
        return n, rows, weights

    def search_arrays(self) -> SearchArrays:
        """The arrays a compiled draft step searches, as they stand now."""
        served = self._served
        return search_arrays(served.indexes, served.stacked)

    def known_prefix(self, tokens: np.ndarray, min_piece: int = 16) -> int:
        """How much of a request's beginning the memory already holds, possibly in pieces: the
        turns a multi-turn request repeats were committed one by one (each only its new part),
        so the prefix is followed from piece to piece while each continues for ``min_piece``
        tokens or more."""
        pos = 0
        while pos < tokens.size:
            n = self._longest_prefix(tokens[pos:])
            if n < min(min_piece, tokens.size - pos):
                break
            pos += n
        return pos

    def _longest_prefix(self, tokens: np.ndarray) -> int:
        """The longest ``n`` such that ``tokens[:n]`` occurs, contiguous, in one index."""
        best = 0
        for index in self.suffix_indexes():
            lo, hi = best, int(tokens.size)  # tokens[:lo] is known to occur somewhere; find more
            if lo == hi or not _occurs(index, tokens[: lo + 1]):
                continue
            lo += 1
            step = 1
            while lo + step <= hi and _occurs(index, tokens[: lo + step]):  # gallop, then bisect
                lo += step
                step *= 2
            hi = min(hi, lo + step - 1)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _occurs(index, tokens[:mid]):
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo)
        return best

    def delta_tokens(self) -> int:
        if self.buffer is None:
            return sum(p.size for p in self._delta_tokens)
        return self.buffer.appended - self._delta_from

    def needs_rebuild(self) -> bool:
        return self.delta_tokens() > self.config.delta_max_tokens

    def rebuild(self) -> LifetimeIndexes:
        """Snapshot the buffer, build, swap. Concurrent callers coalesce into one build: with
        nothing committed since the last generation (a caller that waited on the build that made
        it), that generation is returned as it is, not sorted afresh."""
        if self.buffer is None:
            raise RuntimeError("this memory's indexes are built elsewhere and adopted")
        with self._rebuild_lock:
            previous = self._indexes
            with self._lock:
                version = self.buffer.appended
                if previous is not None and previous.version == version:
                    return previous
                snapshot = self.buffer.snapshot()
            new = version - (0 if previous is None else previous.version)
            built = next_indexes(previous, snapshot, min(new, snapshot.size), self.config, version)
            with self._lock:
                self._indexes = built
                # Drop the delta parts the new main index now covers.
                covered = version - self._delta_from
                self._delta_from = version
                self._trim_delta(covered)
            return built

    def _trim_delta(self, covered: int) -> None:
        while covered > 0 and self._delta_tokens:
            head = self._delta_tokens[0]
            if head.size <= covered:
                covered -= head.size
                self._delta_tokens.pop(0)
                self._delta_ids.pop(0)
            else:
                self._delta_tokens[0] = head[covered:]
                covered = 0
        self._refresh_delta()

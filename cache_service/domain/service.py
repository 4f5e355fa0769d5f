"""The service's domain layer: namespaces, sessions, batched draft/feedback/close.

Every batch is validated whole before any state changes, so a bad item never leaves half a
batch applied. Durable side effects (lifetime log, session state) go through ``Persistence``;
without one the service keeps everything in memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol, TypeVar, overload

import numpy as np

from cache_service.config import ServiceConfig
from cache_service.domain import names
from cache_service.domain.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from cache_service.domain.sessions import SessionEntry, SessionTable, new_session_id
from cache_service.rpc.auth import Principal
from cache_service.storage.stored_session import StoredSession
from indexer.drafter import MAX_LOOKAHEAD, Branches, DraftParams, NamespaceDrafter
from indexer.lifetime_index import LifetimeIndexes
from indexer.prespeculation import Prefetched
from indexer.prior import StaticPrior
from indexer.session import Session
from indexer.session_cache import TableColumns
from indexer.tokens import Namespace, as_tokens
from indexer.tree_builder import DraftTree

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenItem:
    namespace: str
    prompt: np.ndarray | list[int]
    params: DraftParams | None = None
    session_id: str = ""  # chosen by the client (empty: the service picks one)


@dataclass(frozen=True)
class DraftItem:
    session_id: str
    new_tokens: np.ndarray | list[int]
    lookahead: int = 0  # outcomes to draft ahead for (pre-speculation)


@dataclass(frozen=True)
class DraftColumns:
    """Draft items in columns, as a decoder stepping a batch sends them: session
    ``session_ids[j]`` takes the next ``counts[j]`` of ``tokens``, drafting ahead for
    ``lookahead[j]`` outcomes (``None``: none for every session)."""

    session_ids: Sequence[str]
    counts: np.ndarray  # int64, one per session
    tokens: np.ndarray  # int32, every session's new tokens end to end
    lookahead: np.ndarray | None = None  # int64, one per session


def named_sessions(batch: Sequence[DraftItem] | DraftColumns) -> Sequence[str]:
    """The session ids a draft batch names, in order."""
    return batch.session_ids if isinstance(batch, DraftColumns) else [item.session_id for item in batch]


@dataclass(frozen=True)
class FeedbackItem:
    session_id: str
    accepted: np.ndarray | list[int]
    rejected: list[tuple[int, np.ndarray | list[int]]] | None = None


@dataclass(frozen=True)
class CloseItem:
    session_id: str
    commit: bool = True
    commit_from: int = 0
    missing_ok: bool = False  # an unknown session is skipped instead of NOT_FOUND
    new_tokens: np.ndarray | Sequence[int] = ()  # produced since the last call, joining the context first


@dataclass(frozen=True)
class NamespaceStats:
    name: str
    vocab_size: int
    buffered_tokens: int
    requests: int
    index_tokens: int
    last_rebuild_seconds: float
    prior_version: int
    sessions: int


@dataclass(frozen=True)
class SessionDelta:
    """What a session gained since storage last took it: ``tokens`` to append after the
    ``held`` context tokens storage has, and its whole rejected table when that is due."""

    held: int
    tokens: np.ndarray
    rejected: TableColumns | None = None


SessionChange = StoredSession | SessionDelta


@dataclass(frozen=True)
class Opening:
    """An open call checked by :meth:`DraftService.prepare_open`: per item its drafter and
    checked prompt (``None`` where the item repeats the open of a live session)."""

    prepared: list[tuple[OpenItem, NamespaceDrafter, np.ndarray | None]]
    principal: Principal | None

    @property
    def prompt_tokens(self) -> int:
        return sum(p.size for _, _, p in self.prepared if p is not None)


class _DraftStep(NamedTuple):
    """One draft item after its session took its new tokens: the tree drafted ahead for the
    outcome, or ``None`` when it is still to be drafted."""

    entry: SessionEntry
    lookahead: int
    tree: DraftTree | None


class Drafted(Sequence[tuple[DraftTree, Prefetched]]):
    """A draft call's answer, per item: its tree and the trees drafted ahead for it (``ahead``
    ``None``: nothing was). The trees of a batch drafted together stay where the draft step
    left them (:class:`~indexer.tree_builder.DraftedTrees`) until something asks for one."""

    __slots__ = ("ahead", "trees")

    def __init__(self, trees: Sequence[DraftTree], ahead: Sequence[Prefetched] | None = None) -> None:
        self.trees, self.ahead = trees, ahead

    def __len__(self) -> int:
        return len(self.trees)

    @overload
    def __getitem__(self, j: int) -> tuple[DraftTree, Prefetched]: ...

    @overload
    def __getitem__(self, j: slice) -> list[tuple[DraftTree, Prefetched]]: ...

    def __getitem__(self, j: int | slice) -> tuple[DraftTree, Prefetched] | list[tuple[DraftTree, Prefetched]]:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return self.trees[j], {} if self.ahead is None else self.ahead[j]


class Persistence(Protocol):
    """Where durable effects go (Redis in production)."""

    @property
    def pending(self) -> int:
        """Commits accepted but not yet written (storage slow or down)."""
        ...

    def load_session(self, sid: str) -> StoredSession | None: ...

    def namespace_created(self, name: str, vocab_size: int) -> None: ...

    def requests_committed(self, namespace: str, requests: list[np.ndarray]) -> None: ...

    def reload_priors(self, service: DraftService) -> None: ...

    def rebuild(self, service: DraftService, name: str, *, wait: bool = False) -> LifetimeIndexes | None: ...


class DraftService:
    """Batched drafting over many namespaces and sessions."""

    def __init__(
        self, config: ServiceConfig, persistence: Persistence | None = None, *, shared_lifetime: bool = False
    ) -> None:
        self.config = config
        self._persistence = persistence
        if shared_lifetime and persistence is None:
            raise ValueError("shared lifetime indexes come through persistence")
        self._own_ring = not shared_lifetime  # shared: lifetime indexes are adopted, not built here
        self._namespaces: dict[str, NamespaceDrafter] = {}
        self._prior_versions: dict[str, int] = {}
        self.sessions = SessionTable(max_sessions=config.max_sessions, ttl_s=config.session_ttl_s)
        self._drafts = 0  # served trees (updated on the serving thread only)
        self._ns_lock = threading.Lock()
        self._dirty: set[str] = set()  # sessions changed since storage last saw them
        self._round: list[str] = []  # dirty sessions a take_changes round has still to look at
        self._closed: set[str] = set()

    # -- namespaces --------------------------------------------------------------------------

    def create_namespace(
        self, name: str, vocab_size: int, *, persist: bool = True, principal: Principal | None = None
    ) -> NamespaceDrafter:
        if principal is not None:
            principal.check_namespace(name)
        names.namespace_name(name)
        try:
            namespace = Namespace(name=name, vocab_size=vocab_size)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        with self._ns_lock:
            existing = self._namespaces.get(name)
            if existing is not None:
                if existing.namespace.vocab_size != vocab_size:
                    raise AlreadyExists(
                        f"namespace {name!r} exists with vocab_size {existing.namespace.vocab_size}, not {vocab_size}"
                    )
                return existing
            drafter = NamespaceDrafter(namespace, self.config.drafter, own_ring=self._own_ring)
            self._namespaces[name] = drafter
        if persist and self._persistence is not None:
            self._persistence.namespace_created(name, vocab_size)
        logger.info("namespace %s (vocab %d) ready", name, vocab_size)
        return drafter

    def namespace(self, name: str) -> NamespaceDrafter:
        drafter = self._namespaces.get(name)
        if drafter is None:
            raise NotFound(f"unknown namespace {name!r}")
        return drafter

    def namespace_names(self) -> list[str]:
        return sorted(self._namespaces)

    def set_prior(self, name: str, prior: StaticPrior | None, version: int) -> None:
        """Swap a namespace's static prior (one reference assignment: drafts never wait)."""
        self.namespace(name).prior = prior
        self._prior_versions[name] = version

    def prior_version(self, name: str) -> int:
        return self._prior_versions.get(name, 0)

    def stats(self, name: str = "", *, principal: Principal | None = None) -> list[NamespaceStats]:
        """Per namespace; a caller limited to some namespaces sees only those."""
        if name and principal is not None:
            principal.check_namespace(name)
        names = [name] if name else [n for n in self.namespace_names() if principal is None or principal.may_use(n)]
        sessions = self.sessions.count_by_namespace()
        out = []
        for n in names:
            d = self.namespace(n)
            built = d.memory.indexes
            out.append(
                NamespaceStats(
                    name=n,
                    vocab_size=d.namespace.vocab_size,
                    buffered_tokens=d.memory.buffered_tokens,
                    requests=d.memory.requests,
                    index_tokens=0 if built is None else built.suffix.size,
                    last_rebuild_seconds=0.0 if built is None else built.build_seconds,
                    prior_version=self._prior_versions.get(n, 0),
                    sessions=sessions.get(n, 0),
                )
            )
        return out

    @property
    def drafts(self) -> int:
        return self._drafts

    @property
    def pending_writes(self) -> int:
        return 0 if self._persistence is None else self._persistence.pending

    def rebuild(self, name: str = "", *, principal: Principal | None = None) -> list[NamespaceStats]:
        """Reload published priors and rebuild lifetime indexes now (the scheduler does this on
        its own, off the request path)."""
        if principal is not None and principal.namespaces is not None:
            if not name:
                raise PermissionDenied(f"tenant {principal.tenant!r} may rebuild only its own namespaces, by name")
            principal.check_namespace(name)
        if self._persistence is not None:
            self._persistence.reload_priors(self)
        for n in [name] if name else self.namespace_names():
            if self._persistence is not None:
                self._persistence.rebuild(self, n, wait=True)  # asked for now: after a build under way
            else:
                self.namespace(n).memory.rebuild()
        return self.stats(name, principal=principal)

    # -- sessions ----------------------------------------------------------------------------

    def open(self, items: list[OpenItem], *, principal: Principal | None = None) -> list[str]:
        """New sessions; an item whose client-chosen id names a live session of the same
        namespace and tenant gets that session back (a repeated open is answered, not doubled).
        :meth:`prepare_open`, :meth:`build_sessions` and :meth:`finish_open` in one go."""
        return self.finish_open(self.prepare_open(items, principal=principal))

    def prepare_open(self, items: list[OpenItem], *, principal: Principal | None = None) -> Opening:
        """The first part of :meth:`open` (on the serving thread): every item checked, nothing
        changed yet."""
        self._check_batch(len(items))
        tenant = "" if principal is None else principal.tenant
        chosen = [item.session_id for item in items if item.session_id]
        if len(set(chosen)) != len(chosen):
            raise InvalidArgument("session ids chosen in one call must differ")
        prepared: list[tuple[OpenItem, NamespaceDrafter, np.ndarray | None]] = []
        for item in items:
            if principal is not None:
                principal.check_namespace(item.namespace)
            drafter = self.namespace(item.namespace)
            if item.session_id and self._reopened(item, tenant):
                prepared.append((item, drafter, None))
                continue
            prompt = _tokens(item.prompt, drafter, "prompt")
            if prompt.size > self.config.max_prompt_tokens:
                raise ResourceExhausted(f"prompt of {prompt.size} tokens exceeds {self.config.max_prompt_tokens}")
            prepared.append((item, drafter, prompt))
        opening = Opening(prepared, principal)
        self._check_room(opening)
        return opening

    @staticmethod
    def build_sessions(opening: Opening) -> list[Session | None]:
        """The second part of :meth:`open`: the new sessions built (their prompts indexed),
        touching no shared state, so a long prompt can be indexed on a worker thread while the
        serving thread goes on (``None`` where an item repeats an open)."""
        return [None if prompt is None else drafter.open(prompt) for _, drafter, prompt in opening.prepared]

    def finish_open(self, opening: Opening, sessions: list[Session | None] | None = None) -> list[str]:
        """The last part of :meth:`open` (on the serving thread): the sessions held, their ids
        returned. Without ``sessions`` they are built now. Sessions built elsewhere meanwhile
        have the limits checked again and a client-chosen id looked up again, as other calls
        may have changed both while they were built."""
        if sessions is None:
            return self._hold(opening, self.build_sessions(opening), [False] * len(opening.prepared))
        principal = opening.principal
        tenant = "" if principal is None else principal.tenant
        repeated = [
            checked is not None and bool(item.session_id) and self._reopened(item, tenant)
            for item, _, checked in opening.prepared
        ]
        self._check_room(opening, [not r for r in repeated])
        return self._hold(opening, sessions, repeated)

    def _hold(self, opening: Opening, sessions: list[Session | None], repeated: list[bool]) -> list[str]:
        """The sessions built for ``opening`` held in memory, except where ``repeated`` says an
        open of the same id came first; the call's session ids."""
        tenant = "" if opening.principal is None else opening.principal.tenant
        ids = []
        for (item, drafter, checked), session, again in zip(opening.prepared, sessions, repeated, strict=True):
            if checked is None or session is None or again:
                ids.append(item.session_id)
                continue
            entry = SessionEntry(
                sid=item.session_id or new_session_id(),
                namespace=item.namespace,
                drafter=drafter,
                session=session,
                params=item.params or self.config.default_params,
                tenant=tenant,
            )
            self.sessions.add(entry)
            self._dirty.add(entry.sid)
            ids.append(entry.sid)
        return ids

    def _check_room(self, opening: Opening, keep: list[bool] | None = None) -> None:
        """The tenant's limits and the session memory, for the sessions ``opening`` adds (those
        ``keep`` marks, all by default)."""
        prompts = [p for j, (_, _, p) in enumerate(opening.prepared) if p is not None and (keep is None or keep[j])]
        if opening.principal is not None:
            self._check_tenant(opening.principal, len(prompts), sum(p.size for p in prompts))
        self._make_room(sum(p.size for p in prompts))

    def _reopened(self, item: OpenItem, tenant: str) -> bool:
        """Whether a client-chosen id names a live session this open repeats; ``AlreadyExists``
        when it names someone else's."""
        sid = names.client_session_id(item.session_id)
        try:
            entry = self.sessions.get(sid)
        except NotFound:
            return False
        if entry.namespace != item.namespace or entry.tenant != tenant:
            raise AlreadyExists("that session id is taken")
        return True

    def draft(
        self, items: Sequence[tuple[str, np.ndarray | list[int]]], *, principal: Principal | None = None
    ) -> list[DraftTree]:
        """For each ``(session_id, new_tokens)``: append the tokens, then draft."""
        return [tree for tree, _ in self.draft_ahead([DraftItem(sid, new) for sid, new in items], principal=principal)]

    def draft_ahead(
        self,
        items: Sequence[DraftItem] | DraftColumns,
        *,
        principal: Principal | None = None,
        read_storage: bool = True,
    ) -> Drafted:
        """Like :meth:`draft`; each item's ``lookahead`` also drafts ahead for that many likely
        outcomes of verifying its tree. New tokens that match an outcome drafted ahead continue
        with the tree the decoder already holds (the subtree the outcome selects)."""
        if isinstance(items, DraftColumns):
            checked = self._checked_columns(items, principal, read_storage)
        else:
            self._check_batch(len(items))
            for item in items:
                if not 0 <= item.lookahead <= MAX_LOOKAHEAD:
                    raise InvalidArgument(f"lookahead must be in [0, {MAX_LOOKAHEAD}], got {item.lookahead}")
            resolved = [(self._entry(item.session_id, principal, read_storage), item) for item in items]
            checked = [(entry, self._new_tokens(entry, item.new_tokens), item.lookahead) for entry, item in resolved]
        # The sessions take their new tokens, then the trees still to draft are drafted
        # together, one compiled call per namespace for each. A session named twice sees its
        # first draft settled before its second item goes on, as if the items ran one by one.
        parts = [self._step(part) for part in _rounds(checked)]
        out = (
            parts[0]
            if len(parts) == 1
            else Drafted([t for p in parts for t in p.trees], [a for p in parts for _, a in p])
        )
        self._drafts += len(out)
        return out

    def _step(self, items: Sequence[tuple[SessionEntry, np.ndarray, int]]) -> Drafted:
        """One round of a draft call (each session named once)."""
        # Only a session holding trees drafted ahead can have its next tree once it took its
        # tokens: the subtree its outcome selects.
        ahead = any(entry.session.prefetched for entry, _, _ in items)
        self._accept([(entry, new, None) for entry, new, _ in items])
        drafter = items[0][0].drafter if items else None
        if not ahead and all(k == 0 and e.drafter is drafter for e, _, k in items) and drafter is not None:
            entries = [entry for entry, _, _ in items]  # the usual step: one namespace, nothing ahead
            trees = drafter.draft_many([(entry.session, entry.params) for entry in entries])
            self._touched(entries)
            return Drafted(trees)
        steps = [
            _DraftStep(entry, k, entry.session.last_tree if new.size and entry.session.has_tree else None)
            for entry, new, k in items
        ]
        return self._settle(steps)

    def _checked_columns(
        self, cols: DraftColumns, principal: Principal | None, read_storage: bool
    ) -> list[tuple[SessionEntry, np.ndarray, int]]:
        """A columnar batch checked whole (shapes, limits, every id in its session's vocabulary)
        and cut into ``(session, new tokens, lookahead)`` items."""
        n = len(cols.session_ids)
        self._check_batch(n)
        counts, tokens, lookahead = cols.counts, cols.tokens, cols.lookahead
        if counts.shape != (n,):
            raise InvalidArgument(f"{counts.size} new-token counts for {n} sessions")
        if lookahead is None or not lookahead.size:
            lookahead = np.zeros(n, dtype=np.int64)
        elif lookahead.shape != (n,):
            raise InvalidArgument(f"{lookahead.size} lookahead values for {n} sessions")
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise InvalidArgument(f"new tokens must be a flat int32 array, got {tokens.dtype} {tokens.shape}")
        if n and (int(counts.min()) < 0 or int(counts.sum()) != tokens.size):
            raise InvalidArgument(f"new-token counts must add up to the {tokens.size} tokens sent")
        if not n and tokens.size:
            raise InvalidArgument(f"{tokens.size} new tokens for no session")
        if n and int(counts.max()) > self.config.max_new_tokens:
            raise ResourceExhausted(f"{int(counts.max())} new tokens in one call exceed {self.config.max_new_tokens}")
        if n and (int(lookahead.min()) < 0 or int(lookahead.max()) > MAX_LOOKAHEAD):
            raise InvalidArgument(f"lookahead must be in [0, {MAX_LOOKAHEAD}]")
        entries = [self._entry(sid, principal, read_storage) for sid in cols.session_ids]
        vocab = np.repeat(np.array([e.drafter.namespace.vocab_size for e in entries], dtype=np.int64), counts)
        bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
        ends = np.cumsum(counts)
        if bad.size:
            i = int(bad[0])
            j = int(np.searchsorted(ends, i, side="right"))
            at = i - int(ends[j] - counts[j])
            raise InvalidArgument(
                f"namespace {entries[j].namespace}: new tokens: id {int(tokens[i])} at position {at} is outside the "
                f"vocabulary [0, {int(vocab[i])})"
            )
        bounds = [0, *ends.tolist()]
        return [
            (entry, tokens[bounds[j] : bounds[j + 1]], k)
            for j, (entry, k) in enumerate(zip(entries, lookahead.tolist(), strict=True))
        ]

    def _accept(self, items: Sequence[tuple[SessionEntry, np.ndarray, Branches | None]]) -> None:
        """Sessions (each named once) take their checked new tokens, one call per namespace."""
        for entry, new, _ in items:
            if new.size:
                self.sessions.grow(entry, int(new.size))
        for drafter, js in _per_drafter([entry for entry, _, _ in items], [new.size > 0 for _, new, _ in items]):
            drafter.accept_many([(items[j][0].session, items[j][1], items[j][2]) for j in js])

    def _settle(self, steps: list[_DraftStep]) -> Drafted:
        """Draft the trees of ``steps`` still to draft, one compiled call per namespace, then
        draft ahead where asked."""
        entries = [step.entry for step in steps]
        drafted: dict[int, DraftTree] = {}
        for drafter, js in _per_drafter(entries, [step.tree is None for step in steps]):
            trees = drafter.draft_many([(entries[j].session, entries[j].params) for j in js])
            drafted.update(zip(js, trees, strict=True))
        out = [step.tree if step.tree is not None else drafted[j] for j, step in enumerate(steps)]
        # Then the trees drafted ahead, one compiled call per namespace for all of them.
        ahead: list[Prefetched] = [{} for _ in steps]
        for drafter, js in _per_drafter(entries, [step.lookahead > 0 for step in steps]):
            found = drafter.prespeculate_many([(entries[j].session, steps[j].lookahead, entries[j].params) for j in js])
            for j, prefetched in zip(js, found, strict=True):
                ahead[j] = prefetched
        self._touched(entries)
        return Drafted(out, ahead)

    def _touched(self, entries: Sequence[SessionEntry]) -> None:
        """Sessions used now: most recently used, and changed since storage last took them."""
        self.sessions.touch_many(entries)
        self._dirty.update(entry.sid for entry in entries)

    def feedback(
        self, items: list[FeedbackItem], *, principal: Principal | None = None, read_storage: bool = True
    ) -> None:
        self._check_batch(len(items))
        checked = []
        for item in items:
            entry = self._entry(item.session_id, principal, read_storage)
            new = self._new_tokens(entry, item.accepted)
            rejected = None
            if item.rejected is not None:
                rejected = [(off, _tokens(b, entry.drafter, "rejected branch")) for off, b in item.rejected]
                if any(not 0 <= off < new.size for off, _ in rejected):
                    raise InvalidArgument("a rejected branch's offset must point inside the accepted tokens")
            checked.append((entry, new, rejected))
        for part in _rounds(checked):
            self._accept(part)
        self._touched([entry for entry, _, _ in checked])

    def close(
        self, items: list[CloseItem], *, principal: Principal | None = None, read_storage: bool = True
    ) -> list[Callable[[], None]]:
        """End sessions now; return the commits still to run (off the request loop: a commit
        indexes the request, milliseconds of work)."""
        self._check_batch(len(items))
        entries = []
        for item in items:
            try:
                entries.append((self._entry(item.session_id, principal, read_storage), item))
            except NotFound:
                if not item.missing_ok:
                    raise
        if len({entry.sid for entry, _ in entries}) != len(entries):
            raise InvalidArgument("a close call names each session once")
        checked = [(entry, self._new_tokens(entry, item.new_tokens), None) for entry, item in entries]
        for (entry, item), (_, new, _) in zip(entries, checked, strict=True):
            if not 0 <= item.commit_from <= len(entry.session.context) + new.size:
                raise InvalidArgument(f"commit_from {item.commit_from} is outside the session's context")
        self._accept(checked)
        commits: dict[str, list[tuple[SessionEntry, int]]] = {}
        for entry, item in entries:
            self.sessions.pop(entry.sid)
            self._dirty.discard(entry.sid)
            self._closed.add(entry.sid)
            if item.commit:
                commits.setdefault(entry.namespace, []).append((entry, item.commit_from))
        return [partial(self._commit, namespace, group) for namespace, group in commits.items()]

    def _commit(self, namespace: str, group: list[tuple[SessionEntry, int]]) -> None:
        """One namespace's commits of a close call, together: one index run, one log append."""
        added = self.namespace(namespace).close_many([(entry.session, start) for entry, start in group])
        if self._persistence is not None and added:
            self._persistence.requests_committed(namespace, added)

    def _entry(self, sid: str, principal: Principal | None = None, read_storage: bool = True) -> SessionEntry:
        """A live session, or one continued from storage (opened on another replica; without
        ``read_storage``, the caller read storage already). A session in a namespace the caller
        may not use is reported as unknown: its existence is not disclosed."""
        try:
            entry = self.sessions.get(sid)
        except NotFound:
            stored = None
            if read_storage and self._persistence is not None:
                stored = self._persistence.load_session(names.session_id(sid))
            if stored is None:
                raise
            return self._continue(sid, stored, principal)
        if principal is not None and not principal.may_use(entry.namespace):
            raise NotFound(f"unknown or expired session {sid!r}")
        return entry

    def _continue(
        self, sid: str, stored: StoredSession, principal: Principal | None, session: Session | None = None
    ) -> SessionEntry:
        """A session held in memory again from what storage kept of it (``session``: already
        built from it by :meth:`read_stored`)."""
        if principal is not None and not principal.may_use(stored.namespace):
            raise NotFound(f"unknown or expired session {sid!r}")
        drafter = self.namespace(stored.namespace)
        tenant = "" if principal is None else principal.tenant
        if session is None:
            try:
                session = drafter.resume(stored.snapshot)
            except ValueError as exc:  # a stored context outside the namespace's vocabulary
                raise InvalidArgument(f"session {sid!r} cannot continue here: {exc}") from exc
        entry = SessionEntry(sid, stored.namespace, drafter, session, stored.params, tenant)
        entry.stored_tokens = len(entry.session.context)  # storage holds what it was continued from
        entry.stored_table, entry.table_saved_at = entry.session.rejected.table.version, time.monotonic()
        self._make_room(len(entry.session.context))
        self.sessions.add(entry)
        logger.info("session %s continued from storage", sid)
        return entry

    # Sessions another replica opened are read from storage before a call needs them, so that
    # the reading can happen off the thread that serves calls (see the servicer): a slow or
    # unreachable storage then delays only the calls that name such sessions.

    def not_in_memory(self, sids: Iterable[str]) -> list[str]:
        """Which of ``sids`` (once each) this replica does not hold."""
        return [sid for sid in dict.fromkeys(sids) if not self.sessions.holds(sid)]

    def read_stored(self, sids: Sequence[str]) -> dict[str, tuple[StoredSession, Session | None]]:
        """What storage keeps of ``sids`` (those it has), each with the session built from it
        (its prompt indexed); safe on any thread, as it changes nothing the service holds."""
        if self._persistence is None:
            return {}
        found = {sid: self._persistence.load_session(names.session_id(sid)) for sid in sids}
        return {sid: (stored, self._resumed(stored)) for sid, stored in found.items() if stored is not None}

    def _resumed(self, stored: StoredSession) -> Session | None:
        """The session ``stored`` continues, or ``None`` when it cannot be built here (an unknown
        namespace, a snapshot that does not fit it): :meth:`continue_stored` then reports that
        on the serving thread, after checking the caller may know of it."""
        try:
            return self.namespace(stored.namespace).resume(stored.snapshot)
        except (NotFound, ValueError):
            return None

    def continue_stored(
        self, found: dict[str, tuple[StoredSession, Session | None]], *, principal: Principal | None = None
    ) -> None:
        """Hold sessions read by :meth:`read_stored` (on the serving thread); one that came
        back meanwhile, or that the caller may not use, is left alone (the call then answers
        for it as it would have)."""
        for sid, (stored, session) in found.items():
            if self.sessions.holds(sid) or (principal is not None and not principal.may_use(stored.namespace)):
                continue
            self._continue(sid, stored, principal, session)

    def take_changes(
        self, *, final: bool = False, budget_s: float | None = None
    ) -> tuple[list[tuple[str, SessionChange]], list[str]]:
        """Changes of sessions since storage last took them, and ids closed since; call on the
        thread that serves requests (a snapshot must not race a draft).

        A session storage does not hold yet (or holds a different context of) is taken whole;
        one it holds gives only its new tokens, plus its rejected table when that changed and
        ``table_flush_interval_s`` passed since it was last written (always when ``final``). A
        table change not due yet keeps the session pending (it does not leave memory either).

        With ``budget_s``, a call stops looking at sessions once that long has passed (after
        one at least), so the calls it serves wait that long at most; :attr:`taking` says
        whether the sessions changed when the round began are all taken. A session stays
        changed until a call takes it, so it cannot leave memory before.
        """
        began = now = time.monotonic()
        if budget_s is None:
            todo, self._round = list(self._dirty), []
        else:
            if not self._round:
                self._round = list(self._dirty)
            todo = self._round
        changed: list[tuple[str, SessionChange]] = []
        done = 0
        for sid in todo:
            if budget_s is not None and done and time.monotonic() - began >= budget_s:
                break
            done += 1
            if sid not in self._dirty:
                continue  # closed, or taken by a call without a budget, since the round began
            self._dirty.discard(sid)
            try:
                entry = self.sessions.get(sid)
            except NotFound:
                continue  # expired meanwhile
            session = entry.session
            size = len(session.context)
            table = session.rejected.table
            table_changed = table.version != entry.stored_table
            table_due = table_changed and (final or now - entry.table_saved_at >= self.config.table_flush_interval_s)
            if not 0 < entry.stored_tokens <= size:
                changed.append((sid, StoredSession(entry.namespace, session.snapshot(), entry.params)))
                table_changed = table_due = True
            elif size > entry.stored_tokens or table_due:
                new = session.context.tokens[entry.stored_tokens :].copy()
                changed.append((sid, SessionDelta(entry.stored_tokens, new, table.columns() if table_due else None)))
            entry.stored_tokens = size
            if table_due:
                entry.stored_table, entry.table_saved_at = table.version, now
            elif table_changed:
                self._dirty.add(sid)  # pending: looked at again next round
        if budget_s is not None:
            del self._round[:done]
        closed = list(self._closed)
        self._closed.clear()
        return changed, closed

    @property
    def taking(self) -> bool:
        """Whether a round of :meth:`take_changes` with a budget has sessions left to look at."""
        return bool(self._round)

    def requeue(self, sids: Iterable[str], closed: Iterable[str] = ()) -> None:
        """Put back changes storage could not take (on the serving thread, like take_changes):
        the sessions are written whole next time, as what storage holds of them is unknown."""
        for sid in sids:
            try:
                entry = self.sessions.get(sid)
            except NotFound:
                continue
            entry.stored_tokens, entry.stored_table = 0, -1
            self._dirty.add(sid)
        self._closed.update(closed)

    # -- checks ------------------------------------------------------------------------------

    def _make_room(self, tokens: int) -> None:
        """Keep sessions' context tokens in memory under the limit: the least recently used
        sessions that storage already holds leave memory (a later call continues them from
        storage); without storage, idle ones are dropped (their clients re-open them)."""
        limit = self.config.max_session_tokens
        if tokens > limit:
            raise ResourceExhausted(f"{tokens} prompt tokens exceed the session memory of {limit} tokens")
        if self.sessions.tokens + tokens <= limit:
            return
        self.sessions.expire()
        saved = self._persistence is not None
        if not self.sessions.make_room(tokens, limit, lambda sid: not saved or sid not in self._dirty):
            raise ResourceExhausted(
                f"sessions hold {self.sessions.tokens} tokens; {tokens} more exceed {limit} (none can leave memory yet)"
            )

    def _check_tenant(self, principal: Principal, sessions: int, tokens: int) -> None:
        """The tenant's own limits (sessions, context tokens held) with ``sessions`` more."""
        limits = principal.limits
        if not limits.max_sessions and not limits.max_session_tokens:
            return
        self.sessions.expire()
        held, held_tokens = self.sessions.tenant_usage(principal.tenant)
        if limits.max_sessions and held + sessions > limits.max_sessions:
            raise ResourceExhausted(
                f"tenant {principal.tenant!r} holds {held} sessions; its limit is {limits.max_sessions}"
            )
        if limits.max_session_tokens and held_tokens + tokens > limits.max_session_tokens:
            raise ResourceExhausted(
                f"tenant {principal.tenant!r} sessions hold {held_tokens} tokens; its limit is "
                f"{limits.max_session_tokens}"
            )

    def _check_batch(self, size: int) -> None:
        if size > self.config.max_batch:
            raise ResourceExhausted(f"batch of {size} exceeds the limit of {self.config.max_batch}")

    def _new_tokens(self, entry: SessionEntry, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        new = _tokens(tokens, entry.drafter, "new tokens")
        if new.size > self.config.max_new_tokens:
            raise ResourceExhausted(f"{new.size} new tokens in one call exceed {self.config.max_new_tokens}")
        return new


_Item = TypeVar("_Item", bound=tuple)


def _per_drafter(entries: Sequence[SessionEntry], wanted: Sequence[bool]) -> list[tuple[NamespaceDrafter, list[int]]]:
    """The indices of the ``wanted`` entries, grouped by their namespace's drafter (in order)."""
    groups: dict[int, tuple[NamespaceDrafter, list[int]]] = {}
    for j, (entry, want) in enumerate(zip(entries, wanted, strict=True)):
        if want:
            groups.setdefault(id(entry.drafter), (entry.drafter, []))[1].append(j)
    return list(groups.values())


def _rounds(items: Sequence[_Item]) -> Iterator[Sequence[_Item]]:
    """``items`` (each led by its session entry) cut into runs that name each session once."""
    start = 0
    while start < len(items):
        named: set[str] = set()
        end = start
        while end < len(items) and items[end][0].sid not in named:
            named.add(items[end][0].sid)
            end += 1
        yield items[start:end]
        start = end


def _tokens(
    tokens: np.ndarray | Sequence[int], drafter: NamespaceDrafter, what: str, vocab: int | None = None
) -> np.ndarray:
    try:
        return as_tokens(tokens, vocab or drafter.namespace.vocab_size, what=what)
    except ValueError as exc:
        raise InvalidArgument(f"namespace {drafter.namespace.name}: {exc}") from exc

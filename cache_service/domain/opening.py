"""Opening sessions in three parts: checked and limits applied (:meth:`Opener.prepare`), built
(:meth:`Opener.build`, anywhere: a long prompt is indexed off the serving thread), then held
(:meth:`Opener.finish`). A client-chosen id that names a live session of the same namespace
and tenant gets that session back: a repeated open is answered, not doubled. One that names
another tenant's session, live or only in storage, is answered as an unknown session is (the
same NOT_FOUND), and that session is left as it is: no tenant learns of or takes over
another's. While storage is down, what it holds of the chosen ids is unknown: the sessions
open all the same (drafting and commits go on through an outage), and storage keeps another
tenant's session from being written over or deleted by them (see
:class:`~cache_service.domain.changes.Saved`)."""

from __future__ import annotations

import numpy as np

from cache_service.domain import names, tokens
from cache_service.domain.admission import Admission
from cache_service.domain.changes import ChangeTracker
from cache_service.domain.errors import AlreadyExists, InvalidArgument, NotFound, unknown_session
from cache_service.domain.items import Opening, OpenItem
from cache_service.domain.namespaces import Namespaces
from cache_service.domain.sessions import SessionEntry, SessionTable, new_session_id
from cache_service.domain.tenants import Principal, owns, tenant_of
from indexer.drafter import DraftParams, NamespaceDrafter
from indexer.session import Session


class Opener:
    """Opens sessions into ``sessions``, each marked changed (storage has none of it yet)."""

    def __init__(
        self,
        default_params: DraftParams,
        namespaces: Namespaces,
        sessions: SessionTable,
        admission: Admission,
        changes: ChangeTracker,
    ) -> None:
        self._default_params = default_params
        self._namespaces = namespaces
        self._sessions = sessions
        self._admission = admission
        self._changes = changes

    @staticmethod
    def chosen_ids(items: list[OpenItem]) -> list[str]:
        """The ids the client chose, each checked (before storage is asked about any)."""
        chosen = [names.client_session_id(item.session_id) for item in items if item.session_id]
        if len(set(chosen)) != len(chosen):
            raise InvalidArgument("session ids chosen in one call must differ")
        return chosen

    def prepare(
        self, items: list[OpenItem], principal: Principal | None, claimed: frozenset[str], *, unchecked: bool = False
    ) -> Opening:
        """Every item checked (on the serving thread), nothing changed yet; ``claimed``: the
        chosen ids storage holds for another tenant (``unchecked``: storage could not say)."""
        self._admission.batch(len(items))
        self.chosen_ids(items)
        prepared: list[tuple[OpenItem, NamespaceDrafter, np.ndarray | None]] = []
        for item in items:
            names.namespace_name(item.namespace)
            names.tokenizer(item.tokenizer)
            if principal is not None:
                principal.check_namespace(item.namespace)
            drafter = self._namespaces.get(item.namespace, item.vocab_size, item.tokenizer)
            if item.session_id and self._reopened(item, principal, claimed):
                prepared.append((item, drafter, None))
                continue
            prompt = tokens.checked(item.prompt, drafter, "prompt")
            self._admission.prompt(prompt.size)
            prepared.append((item, drafter, prompt))
        opening = Opening(prepared, principal, claimed, unchecked)
        self._admission.room_for(opening)
        return opening

    @staticmethod
    def build(opening: Opening) -> list[Session | None]:
        """The new sessions built (their prompts indexed), touching no shared state, so a long
        prompt can be indexed on a worker thread while the serving thread goes on (``None``
        where an item repeats an open)."""
        return [None if prompt is None else drafter.open_checked(prompt) for _, drafter, prompt in opening.prepared]

    def finish(self, opening: Opening, sessions: list[Session | None], *, built_now: bool) -> list[str]:
        """The sessions held (on the serving thread), their ids returned. Sessions built
        elsewhere meanwhile (not ``built_now``) have the limits checked again and a
        client-chosen id looked up again, as other calls may have changed both while they
        were built."""
        if built_now:
            return self._hold(opening, sessions, [False] * len(opening.prepared))
        repeated = [
            checked is not None and bool(item.session_id) and self._reopened(item, opening.principal, opening.claimed)
            for item, _, checked in opening.prepared
        ]
        self._admission.room_for(opening, [not r for r in repeated])
        return self._hold(opening, sessions, repeated)

    def _hold(self, opening: Opening, sessions: list[Session | None], repeated: list[bool]) -> list[str]:
        """The sessions built for ``opening`` held in memory, except where ``repeated`` says an
        open of the same id came first; the call's session ids. All or none: a failure part-way
        lets go of those held already (the client never learns their ids)."""
        tenant = tenant_of(opening.principal)
        ids, added = [], []
        try:
            for (item, drafter, checked), session, again in zip(opening.prepared, sessions, repeated, strict=True):
                if checked is None or session is None or again:
                    ids.append(item.session_id)
                    continue
                params = item.params or self._default_params
                sid = item.session_id or new_session_id()
                unchecked = opening.unchecked and bool(item.session_id)  # ids made here are new
                self._sessions.add(SessionEntry(sid, item.namespace, drafter, session, params, tenant, unchecked))
                added.append(sid)
                ids.append(sid)
        except BaseException:
            for sid in added:
                self._sessions.discard(sid)
            raise
        self._changes.changed(added)
        return ids

    def _reopened(self, item: OpenItem, principal: Principal | None, claimed: frozenset[str]) -> bool:
        """Whether a client-chosen id names a live session this open repeats. Another tenant's
        session (live, or in storage: ``claimed``) is unknown to the caller: the NOT_FOUND an
        unknown session gets. ``AlreadyExists`` when it names the caller's own session of
        another namespace."""
        sid = item.session_id
        try:
            entry = self._sessions.get(sid)
        except NotFound:
            if sid in claimed:
                raise
            return False
        if not owns(principal, entry.tenant, entry.namespace):
            raise unknown_session(sid)
        if entry.namespace != item.namespace:
            raise AlreadyExists("that session id is taken by another of your sessions")
        return True

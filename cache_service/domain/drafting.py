"""The draft step of a batch whose items are checked: sessions take their new tokens, then the
trees still to draft are drafted together, one compiled call per namespace, and drafted ahead
where asked. Nothing here checks or fails on client input."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import numpy as np

from cache_service.domain.items import Drafted
from cache_service.domain.sessions import SessionEntry, SessionTable
from cache_service.domain.tokens import TopkPart
from indexer.drafter import Branches, NamespaceDrafter
from indexer.prespeculation import Prefetched
from indexer.tree_builder import DraftTree

Accepted = tuple[SessionEntry, np.ndarray, Branches | None]  # a session, its new tokens, branches
Step = tuple[SessionEntry, np.ndarray, int]  # a session, its new tokens, outcomes to draft ahead for
Touched = Callable[[Sequence[SessionEntry]], None]  # sessions just used
_Item = TypeVar("_Item", bound=tuple)


class _Pending(NamedTuple):
    """One draft item after its session took its new tokens: the tree drafted ahead for the
    outcome, or ``None`` when it is still to be drafted."""

    entry: SessionEntry
    lookahead: int
    tree: DraftTree | None


def draft(items: Sequence[Step], sessions: SessionTable, touched: Touched, *, ahead: bool = True) -> Drafted:
    """Every item's tree (and what was drafted ahead for it; without ``ahead``, nothing is,
    and nothing drafted earlier stays). A session named twice sees its first draft settled
    before its second item goes on, as if the items ran one by one."""
    parts = [_step(part, sessions, touched, ahead) for part in rounds(items)]
    if len(parts) == 1:
        return parts[0]
    return Drafted([t for p in parts for t in p.trees], [a for p in parts for _, a in p])


def observe_topk(items: Sequence[Step], topk: Sequence[TopkPart | None]) -> None:
    """Checked top-k rows feed their namespaces' successor tables, before the sessions take
    their tokens: each after the token the item names for it, or after the new tokens (row 0
    follows a session's last token; a session named twice continues from its earlier item's
    tokens)."""
    last: dict[int, int] = {}
    for (entry, new, _), part in zip(items, topk, strict=True):
        after, rows = part if part is not None else (None, None)
        if after is not None and rows is not None:
            entry.drafter.successors.observe(after, rows)
        if not new.size:
            continue
        key = id(entry.session)
        if after is None and rows is not None:
            before = last.get(key)
            if before is None and len(entry.session.context):
                before = int(entry.session.context.tokens[-1])
            if before is not None:
                prev = np.concatenate((np.array([before], dtype=np.int32), new[:-1]))
                entry.drafter.successors.observe(prev, rows)
        last[key] = int(new[-1])


def accept(items: Sequence[Accepted], sessions: SessionTable) -> None:
    """Sessions (each named once) take their checked new tokens, one call per namespace."""
    for entry, new, _ in items:
        if new.size:
            sessions.grow(entry, int(new.size))
    for drafter, js in per_drafter([entry for entry, _, _ in items], [new.size > 0 for _, new, _ in items]):
        drafter.accept_many([(items[j][0].session, items[j][1], items[j][2]) for j in js])


def _step(items: Sequence[Step], sessions: SessionTable, touched: Touched, ahead_wanted: bool) -> Drafted:
    """One round of a draft call (each session named once)."""
    # Only a session holding trees drafted ahead can have its next tree once it took its
    # tokens: the subtree its outcome selects.
    ahead = any(entry.session.prefetched for entry, _, _ in items)
    accept([(entry, new, None) for entry, new, _ in items], sessions)
    drafter = items[0][0].drafter if items else None
    if not ahead and all(k == 0 and e.drafter is drafter for e, _, k in items) and drafter is not None:
        entries = [entry for entry, _, _ in items]  # the usual step: one namespace, nothing ahead
        trees = drafter.draft_many([(entry.session, entry.params) for entry in entries])
        touched(entries)
        return Drafted(trees)
    pending = [_Pending(entry, k, _held(entry, new, k)) for entry, new, k in items]
    return _settle(pending, touched, ahead_wanted)


def _held(entry: SessionEntry, new: np.ndarray, lookahead: int) -> DraftTree | None:
    """The item's tree where the session already holds it, once it took its new tokens: the
    one drafted ahead for the outcome those tokens are (``None``: still to draft).

    An item with no new tokens that asks for outcomes ahead, on a session still holding the
    draft made for its context (a tree, or in chain mode the chain sent), gets that draft again
    and what was drafted ahead of it: a client that asked for its step's drafts alone asks for
    what lies ahead of them in a call of its own, and the context is not drafted twice (nor
    the chain it verifies replaced by another)."""
    session = entry.session
    if not session.has_tree:
        return None
    if new.size:
        return session.last_tree
    if lookahead and not entry.params.chain:
        return session.last_tree
    if lookahead and session.chain is not None:
        return session.chain.tree()
    return None


def _settle(steps: list[_Pending], touched: Touched, ahead_wanted: bool) -> Drafted:
    """Draft the trees of ``steps`` still to draft, one compiled call per namespace, then draft
    ahead where asked (where ``ahead_wanted``)."""
    entries = [step.entry for step in steps]
    drafted: dict[int, DraftTree] = {}
    for drafter, js in per_drafter(entries, [step.tree is None for step in steps]):
        trees = drafter.draft_many([(entries[j].session, entries[j].params) for j in js])
        drafted.update(zip(js, trees, strict=True))
    out = [step.tree if step.tree is not None else drafted[j] for j, step in enumerate(steps)]
    # Then the trees drafted ahead, one compiled call per namespace for all of them.
    ahead: list[Prefetched] = [{} for _ in steps]
    for drafter, js in per_drafter(entries, [step.lookahead > 0 for step in steps]):
        if not ahead_wanted:
            drafter.forgo_ahead([entries[j].session for j in js])
            continue
        found = drafter.prespeculate_many([(entries[j].session, steps[j].lookahead, entries[j].params) for j in js])
        for j, prefetched in zip(js, found, strict=True):
            ahead[j] = prefetched
    touched(entries)
    return Drafted(out, ahead)


def per_drafter(entries: Sequence[SessionEntry], wanted: Sequence[bool]) -> list[tuple[NamespaceDrafter, list[int]]]:
    """The indices of the ``wanted`` entries, grouped by their namespace's drafter (in order)."""
    groups: dict[int, tuple[NamespaceDrafter, list[int]]] = {}
    for j, (entry, want) in enumerate(zip(entries, wanted, strict=True)):
        if want:
            groups.setdefault(id(entry.drafter), (entry.drafter, []))[1].append(j)
    return list(groups.values())


def rounds(items: Sequence[_Item]) -> Iterator[Sequence[_Item]]:
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

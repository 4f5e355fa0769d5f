"""Compiled leader -> followers LRU tables, each held in one int64 array.

A table maps a *leader* (``ll`` tokens) to at most ``mf`` *followers* (up to ``fl`` tokens each)
with a count per follower. Both levels are least-recently-updated first out: adding to a leader
(or adding a follower it already has) refreshes it, and when a capacity is reached the least
recently updated leader (or follower of that leader) goes. Lookups change nothing.

Everything lives in the array, so compiled code can read and update a table in place and one
array describes it whole (copying, storing and sharing need nothing else):

- a header (:data:`HEADER` slots): live leaders, leader slots, version (every add), clock,
  ``ll``, ``fl``, ``mf``, most leaders, hash slots;
- leader keys (slots x ``ll``), each slot's stamp (0: empty), the hash index (open
  addressing, linear probing; -1: empty), then per slot ``mf`` followers of ``3 + fl`` values:
  length (0: empty), count, stamp, tokens.

Recency is a stamp from the table's clock. A table starts small and doubles up to its most
leaders, so a session that never sees a rejection costs a few hundred bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

N, SLOTS, VERSION, CLOCK, LL, FL, MF, MAX_LEADERS, HASH = range(9)
HEADER = 9
_FIRST_SLOTS = 4


@njit(cache=True, nogil=True)
def _hash_slots(slots: int) -> int:
    h = 8
    while h < 2 * slots:
        h <<= 1
    return h


@njit(cache=True, nogil=True)
def _size(slots: int, ll: int, fl: int, mf: int) -> int:
    return HEADER + slots * ll + slots + _hash_slots(slots) + slots * mf * (3 + fl)


@njit(cache=True, nogil=True)
def _regions(t: np.ndarray) -> tuple[int, int, int, int]:
    """Where the keys, stamps, hash index and followers start."""
    slots = t[SLOTS]
    keys = HEADER
    stamps = keys + slots * t[LL]
    index = stamps + slots
    return keys, stamps, index, index + t[HASH]


@njit(cache=True, nogil=True)
def _empty(slots: int, ll: int, fl: int, mf: int, max_leaders: int) -> np.ndarray:
    t = np.zeros(_size(slots, ll, fl, mf), dtype=np.int64)
    t[SLOTS], t[LL], t[FL], t[MF], t[MAX_LEADERS], t[HASH] = slots, ll, fl, mf, max_leaders, _hash_slots(slots)
    _, _, index, _ = _regions(t)
    t[index : index + t[HASH]] = -1
    return t


@njit(cache=True, nogil=True)
def new_table(ll: int, fl: int, mf: int, max_leaders: int) -> np.ndarray:
    """An empty table."""
    return _empty(min(_FIRST_SLOTS, max_leaders), ll, fl, mf, max_leaders)


@njit(cache=True, nogil=True)
def _key_hash(tokens: np.ndarray, start: int, ll: int) -> int:
    h = np.uint64(14695981039346656037)
    for i in range(ll):
        h = (h ^ np.uint64(tokens[start + i] & 0xFFFFFFFF)) * np.uint64(1099511628211)
    h ^= h >> np.uint64(29)
    return int(h & np.uint64(0x7FFFFFFFFFFFFFFF))


@njit(cache=True, nogil=True)
def _same_key(t: np.ndarray, slot: int, tokens: np.ndarray, start: int) -> bool:
    ll = t[LL]
    k = HEADER + slot * ll
    for i in range(ll):  # noqa: SIM110 (compiled: a plain loop, no generator)
        if t[k + i] != tokens[start + i]:
            return False
    return True


@njit(cache=True, nogil=True)
def find(t: np.ndarray, tokens: np.ndarray, start: int) -> int:
    """The slot of leader ``tokens[start:start + ll]``, or -1."""
    _, _, index, _ = _regions(t)
    mask = t[HASH] - 1
    h = _key_hash(tokens, start, t[LL]) & mask
    while True:
        slot = t[index + h]
        if slot < 0:
            return -1
        if _same_key(t, slot, tokens, start):
            return slot
        h = (h + 1) & mask


@njit(cache=True, nogil=True)
def _index_put(t: np.ndarray, slot: int) -> None:
    _, _, index, _ = _regions(t)
    mask = t[HASH] - 1
    h = _key_hash(t, HEADER + slot * t[LL], t[LL]) & mask
    while t[index + h] >= 0:
        h = (h + 1) & mask
    t[index + h] = slot


@njit(cache=True, nogil=True)
def _index_remove(t: np.ndarray, slot: int) -> None:
    """Backward-shift deletion: entries after the hole that may move into it do."""
    _, _, index, _ = _regions(t)
    mask, ll = t[HASH] - 1, t[LL]
    h = _key_hash(t, HEADER + slot * ll, ll) & mask
    while t[index + h] != slot:
        h = (h + 1) & mask
    hole = h
    j = hole
    while True:
        j = (j + 1) & mask
        s = t[index + j]
        if s < 0:
            break
        home = _key_hash(t, HEADER + s * ll, ll) & mask
        # s may fill the hole when its home is not cyclically within (hole, j].
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            t[index + hole] = s
            hole = j
    t[index + hole] = -1


@njit(cache=True, nogil=True)
def _grown(t: np.ndarray) -> np.ndarray:
    """The table with twice the leader slots (at most its most leaders), live leaders first."""
    slots = min(2 * t[SLOTS], t[MAX_LEADERS])
    ll, fl, mf = t[LL], t[FL], t[MF]
    out = _empty(slots, ll, fl, mf, t[MAX_LEADERS])
    out[N], out[VERSION], out[CLOCK] = t[N], t[VERSION], t[CLOCK]
    _, stamps, _, fols = _regions(t)
    _, o_stamps, _, o_fols = _regions(out)
    width = mf * (3 + fl)
    k = 0
    for s in range(t[SLOTS]):
        if t[stamps + s] == 0:
            continue
        out[HEADER + k * ll : HEADER + (k + 1) * ll] = t[HEADER + s * ll : HEADER + (s + 1) * ll]
        out[o_stamps + k] = t[stamps + s]
        out[o_fols + k * width : o_fols + (k + 1) * width] = t[fols + s * width : fols + (s + 1) * width]
        _index_put(out, k)
        k += 1
    return out


@njit(cache=True, nogil=True)
def _oldest(t: np.ndarray, start: int, count: int, stride: int) -> int:
    """Among ``count`` live entries whose stamps are ``stride`` apart from ``start``, the one
    updated least recently."""
    best, best_stamp = -1, 0
    for i in range(count):
        stamp = t[start + i * stride]
        if stamp != 0 and (best < 0 or stamp < best_stamp):
            best, best_stamp = i, stamp
    return best


@njit(cache=True, nogil=True)
def add(t: np.ndarray, leader: np.ndarray, lo: int, follower: np.ndarray, fo: int, flen: int, count: int) -> np.ndarray:
    """Add ``count`` to follower ``follower[fo:fo + flen]`` (cut to ``fl`` tokens) of leader
    ``leader[lo:lo + ll]``; returns the table, which is a new, larger array when it grew (a
    table only ever grows)."""
    flen = min(flen, t[FL])
    slot = find(t, leader, lo)
    if slot < 0:
        if t[N] == t[SLOTS] and t[SLOTS] < t[MAX_LEADERS]:
            t = _grown(t)
        keys, stamps, _, fols = _regions(t)
        ll, width = t[LL], t[MF] * (3 + t[FL])
        if t[N] == t[SLOTS]:  # full: the least recently updated leader goes
            slot = _oldest(t, stamps, t[SLOTS], 1)
            _index_remove(t, slot)
            t[N] -= 1
        else:
            slot = 0
            while t[stamps + slot] != 0:
                slot += 1
        for i in range(ll):
            t[keys + slot * ll + i] = leader[lo + i]
        t[fols + slot * width : fols + (slot + 1) * width] = 0
        t[N] += 1
        _index_put(t, slot)
    _, stamps, _, fols = _regions(t)
    t[VERSION] += 1
    t[CLOCK] += 1
    t[stamps + slot] = t[CLOCK]
    mf, fl = t[MF], t[FL]
    base = fols + slot * mf * (3 + fl)
    at = -1
    free = -1
    for f in range(mf):
        e = base + f * (3 + fl)
        if t[e] == 0:
            if free < 0:
                free = f
            continue
        if t[e] == flen:
            same = True
            for i in range(flen):
                if t[e + 3 + i] != follower[fo + i]:
                    same = False
                    break
            if same:
                at = f
                break
    if at >= 0:
        e = base + at * (3 + fl)
        t[e + 1] += count
        t[e + 2] = t[CLOCK]
        return t
    if free < 0:  # every follower taken: the least recently updated one goes
        free = _oldest(t, base + 2, mf, 3 + fl)
    e = base + free * (3 + fl)
    t[e], t[e + 1], t[e + 2] = flen, count, t[CLOCK]
    for i in range(fl):
        t[e + 3 + i] = follower[fo + i] if i < flen else -1
    return t


@njit(cache=True, nogil=True)
def _by_recency(t: np.ndarray, base: int, mf: int, stride: int, newest_first: bool) -> np.ndarray:
    """Indices of the live followers at ``base`` ordered by stamp."""
    order = np.empty(mf, dtype=np.int64)
    k = 0
    for f in range(mf):
        if t[base + f * stride] != 0:
            order[k] = f
            k += 1
    order = order[:k]
    for i in range(1, k):  # a handful of entries: insertion sort
        f = order[i]
        stamp = t[base + f * stride + 2]
        j = i - 1
        while j >= 0 and ((t[base + order[j] * stride + 2] < stamp) == newest_first):
            order[j + 1] = order[j]
            j -= 1
        order[j + 1] = f
    return order


@njit(cache=True, nogil=True)
def followers_at(t: np.ndarray, slot: int, newest_first: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot ``slot``'s followers as ``(rows padded with -1, lengths, counts)``."""
    mf, fl = t[MF], t[FL]
    _, _, _, fols = _regions(t)
    base = fols + slot * mf * (3 + fl)
    order = _by_recency(t, base, mf, 3 + fl, newest_first)
    rows = np.full((order.size, fl), -1, dtype=np.int32)
    lengths = np.zeros(order.size, dtype=np.int64)
    counts = np.zeros(order.size, dtype=np.int64)
    for i in range(order.size):
        e = base + order[i] * (3 + fl)
        lengths[i], counts[i] = t[e], t[e + 1]
        for j in range(t[e]):
            rows[i, j] = t[e + 3 + j]
    return rows, lengths, counts


@njit(cache=True, nogil=True)
def candidates(t: np.ndarray, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Followers of the context's last ``ll`` tokens, most recent first, as ``(rows padded
    with -1 to fl, weights = counts)``; no rows when the leader is unknown."""
    ll = t[LL]
    if t[N] == 0 or context.size < ll:
        return np.zeros((0, t[FL]), dtype=np.int32), np.zeros(0)
    slot = find(t, context, context.size - ll)
    if slot < 0:
        return np.zeros((0, t[FL]), dtype=np.int32), np.zeros(0)
    rows, _, counts = followers_at(t, slot, True)
    return rows, counts.astype(np.float64)


@njit(cache=True, nogil=True)
def leaders_oldest_first(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Live leaders, least recently updated first: ``(slots, keys)``."""
    _, stamps, _, _ = _regions(t)
    slots = np.empty(t[N], dtype=np.int64)
    k = 0
    for s in range(t[SLOTS]):
        if t[stamps + s] != 0:
            slots[k] = s
            k += 1
    order = np.argsort(t[stamps + slots[:k]], kind="mergesort")
    slots = slots[:k][order]
    ll = t[LL]
    keys = np.empty((k, ll), dtype=np.int64)
    for i in range(k):
        keys[i] = t[HEADER + slots[i] * ll : HEADER + (slots[i] + 1) * ll]
    return slots, keys


@njit(cache=True, nogil=True)
def columns(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The whole table as flat columns, least recently updated leader first and each leader's
    followers oldest first (the order that replays it by :func:`add`): ``(leader lengths,
    followers per leader, follower lengths, counts, leader tokens, follower tokens)``."""
    slots, keys = leaders_oldest_first(t)
    n, fl, mf = slots.size, t[FL], t[MF]
    stride = 3 + fl
    _, _, _, fols = _regions(t)
    fanout = np.empty(n, dtype=np.int64)
    lengths = np.empty(n * mf, dtype=np.int64)
    counts = np.empty(n * mf, dtype=np.int64)
    tokens = np.empty(n * mf * fl, dtype=np.int64)
    f = k = 0
    for i in range(n):
        base = fols + slots[i] * mf * stride
        order = _by_recency(t, base, mf, stride, False)
        fanout[i] = order.size
        for o in order:
            e = base + o * stride
            lengths[f], counts[f] = t[e], t[e + 1]
            f += 1
            tokens[k : k + t[e]] = t[e + 3 : e + 3 + t[e]]
            k += t[e]
    return np.full(n, t[LL], dtype=np.int64), fanout, lengths[:f], counts[:f], keys.ravel(), tokens[:k]

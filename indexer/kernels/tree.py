"""The compiled draft-tree merge: a trie of every tier's rows, scored per node, kept best first
(by score, or by the chance verification reaches the node)."""

from __future__ import annotations

import numpy as np
from numba import njit

from indexer.kernels.chain import TRACKS, cell_rate, node_cell

# -- tree merge -----------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _row_order(rows: np.ndarray) -> np.ndarray:
    """Stable lexicographic order of rows (-1, an ended row, sorts first): merge sort."""
    r = rows.shape[0]
    order = np.arange(r)
    tmp = np.empty(r, dtype=np.int64)
    width = 1
    while width < r:
        for start in range(0, r, 2 * width):
            mid = min(start + width, r)
            stop = min(start + 2 * width, r)
            i, j, k = start, mid, start
            while i < mid and j < stop:
                a, b = order[i], order[j]
                less = False  # rows[b] < rows[a]?
                for d in range(rows.shape[1]):
                    if rows[a, d] != rows[b, d]:
                        less = rows[b, d] < rows[a, d]
                        break
                if less:
                    tmp[k] = b
                    j += 1
                else:
                    tmp[k] = a
                    i += 1
                k += 1
            while i < mid:
                tmp[k] = order[i]
                i += 1
                k += 1
            while j < stop:
                tmp[k] = order[j]
                j += 1
                k += 1
        order, tmp = tmp, order
        width *= 2
    return order


@njit(cache=True, nogil=True)
def _best(value: np.ndarray, score: np.ndarray, skip: np.ndarray, min_score: float, m: int) -> np.ndarray:
    """Ids of the ``m`` highest values of nodes scoring above ``min_score`` not in ``skip``;
    ties to lower ids."""
    if m <= 0:
        return np.zeros(0, dtype=np.int64)
    buf = np.empty(m, dtype=np.int64)  # sorted best first
    size = 0
    for node in range(value.size):
        v = value[node]
        if skip[node] or score[node] <= min_score or (size == m and v <= value[buf[m - 1]]):
            continue
        pos = size if size < m else m - 1
        while pos > 0 and value[buf[pos - 1]] < v:  # equal values stay ahead (lower ids)
            if pos < m:
                buf[pos] = buf[pos - 1]
            pos -= 1
        buf[pos] = node
        if size < m:
            size += 1
    return buf[:size]


@njit(cache=True, nogil=True)
def _level_reach(
    lo: int,
    hi: int,
    depth: int,
    parent: np.ndarray,
    score: np.ndarray,
    source: np.ndarray,
    reach: np.ndarray,
    calibration: tuple,
) -> None:
    """The reach of nodes ``[lo, hi)``, one level ``depth`` deep (from 1), whose parents' reach
    is known, for ``calibration`` as :func:`merge_tree` takes it (its track record clamped to
    the records there are): each parent's reach times the node's calibrated conditional (at
    most 1, so reach never grows from parent to child). A parent's children are consecutive
    ids; its best-scoring one (ties to the earlier) is the child a chain takes, the
    calibration's rank 0.
    Scores are binned as the float32 the tree carries, as the outcomes that teach the
    calibration are."""
    track, score_edges, hits, trials, coarse, fine_prior = calibration
    track = min(track, TRACKS - 1)
    i = lo
    while i < hi:
        p = parent[i]
        end = i
        best = i
        while end < hi and parent[end] == p:
            if score[end] > score[best]:
                best = end
            end += 1
        above = 1.0 if p < 0 else np.float64(np.float32(score[p]))
        up = 1.0 if p < 0 else reach[p]
        for c in range(i, end):
            r, s, t, d, k, b = node_cell(
                np.float64(np.float32(score[c])), above, source[c], depth, track, 0 if c == best else 1, score_edges
            )
            reach[c] = up * min(cell_rate(r, s, t, d, k, b, hits, trials, coarse, fine_prior), 1.0)
        i = end


@njit(cache=True, nogil=True)
def no_calibration() -> tuple:
    """A :func:`merge_tree` calibration that ranks nodes by score."""
    cells = np.zeros((1, 1, 1, 1, 1, 1))
    return -1, np.zeros(0), cells, cells, np.zeros((1, 1)), 0.0


@njit(cache=True, nogil=True)
def merge_tree(
    rows: np.ndarray,
    vals: np.ndarray,
    is_max: np.ndarray,
    tiers: np.ndarray,
    n_tiers: int,
    budget: int,
    min_score: float,
    depth_reserve: int,
    calibration: tuple,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Trie of all rows; per node and tier the summed (weights) or best (probs) value; keep the
    reserved best chain and then the highest-ranked nodes scoring above ``min_score``, parents
    first.

    ``calibration`` is ``(track, score_edges, cell_hits, cell_trials, coarse, fine_prior)``
    (:func:`no_calibration`: none). With ``track`` < 0 nodes rank by score. Otherwise by their
    reach: the chance verification accepts the node, the product along its path of each node's
    calibrated conditional (:mod:`indexer.chain`'s cells for a session of track-record bin
    ``track``, each cell's rate backed off to ``coarse``). A tree's expected accepted length is
    the sum of its nodes' reach, so those nodes make the tree of its size the target follows
    furthest; the scores, which sum the tiers' votes and cap at 1, are not probabilities.

    Returns ``(tokens, parents, sources, scores, first_token, first_value)``, the last two per
    tier: its best first-level token (-1 if none) and that token's value.

    Rows are sorted once; level by level, the rows under one node are then a consecutive run,
    so each node's per-tier values are summed in one small buffer while its run is walked and
    the node is scored as soon as the run ends (no node x tier matrix). Only rows still
    growing are walked: ended rows and those under pruned nodes leave the list.
    """
    r_count, depth = rows.shape
    active = _row_order(rows)  # rows still growing, in sorted order
    n_active = r_count
    node_of = np.full(r_count, -1, dtype=np.int64)  # per row: its node at the level last built
    cap = r_count * depth
    token = np.empty(cap, dtype=np.int32)
    parent = np.empty(cap, dtype=np.int64)
    score = np.empty(cap)
    source = np.empty(cap, dtype=np.uint8)
    child_lo = np.empty(cap + 1, dtype=np.int64)  # slot 0 is the root; children are consecutive ids
    child_hi = np.empty(cap + 1, dtype=np.int64)
    by_reach = calibration[0] >= 0
    reach = np.empty(cap if by_reach else 0)
    value = reach if by_reach else score  # what nodes rank by
    acc = np.zeros(n_tiers)
    first_tok = np.full(n_tiers, -1, dtype=np.int64)
    first_val = np.zeros(n_tiers)
    top = np.empty(max(budget, 1))  # min-heap of the best `budget` scores so far
    top_size = 0
    chain = -1  # the reserved chain's deepest node (-1: the root)
    chain_len = 0
    chain_open = min(depth_reserve, budget) > 0
    n = 0
    n_first = 0
    for d in range(depth):
        level_start = n
        kept = 0
        last_parent, last_token = -2, -2
        for a in range(n_active):
            row = active[a]
            t = rows[row, d]
            if t < 0:  # the row ended
                continue
            p = node_of[row] if d > 0 else -1
            # Sorted rows under one parent with one token form one node: a new run starts one.
            if p != last_parent or t != last_token:
                if n > level_start:
                    _close_node(n - 1, acc, score, source, parent, d == 0, token, first_tok, first_val)
                token[n] = t
                parent[n] = p
                child_lo[n + 1] = cap
                child_hi[n + 1] = 0
                if p >= 0:
                    if n < child_lo[p + 1]:
                        child_lo[p + 1] = n
                    child_hi[p + 1] = n + 1
                n += 1
                last_parent, last_token = p, t
            node_of[row] = n - 1
            active[kept] = row
            kept += 1
            k = tiers[row]
            v = vals[row, d]
            if is_max[row]:
                if v > acc[k]:
                    acc[k] = v
            else:
                acc[k] += v
        if n > level_start:
            _close_node(n - 1, acc, score, source, parent, d == 0, token, first_tok, first_val)
        if d == 0:
            n_first = n
            child_lo[0], child_hi[0] = 0, n_first
        if kept == 0:
            break
        if by_reach:
            _level_reach(level_start, n, d + 1, parent, score, source, reach, calibration)
        # Pruning. Neither scores nor reach grow from parent to child, so a node ranking below
        # the `budget`-th best seen so far (or not scoring above min_score) can be neither kept
        # nor lead to a kept node: its rows stop here. So can one that only ties the
        # `budget`-th best of the levels above, as ties go to lower ids. The reserved chain's
        # node is exempt, as the chain follows the best child wherever it leads.
        above = top[0] if 0 < budget == top_size else -np.inf
        for node in range(level_start, n):
            v = value[node]
            if top_size < budget:
                top[top_size] = v
                top_size += 1
                _sift_up(top, top_size - 1)
            elif v > top[0]:
                top[0] = v
                _sift_down(top, top_size)
        if chain_open:
            best = -1
            for c in range(child_lo[chain + 1], child_hi[chain + 1]):
                if score[c] > min_score and (best < 0 or score[c] > score[best]):
                    best = c
            if best < 0:
                chain_open = False
            else:
                chain = best
                chain_len += 1
                chain_open = chain_len < min(depth_reserve, budget)
        floor = top[0] if 0 < budget == top_size else -np.inf
        n_active = 0
        for a in range(kept):
            row = active[a]
            node = node_of[row]
            if node == chain or not (score[node] <= min_score or value[node] <= above or value[node] < floor):
                active[n_active] = row
                n_active += 1
    chosen = np.zeros(n, dtype=np.bool_)
    taken = 0
    # Depth reserve: the greedy best chain (ties to the lower id) goes in first.
    node = -1
    while taken < min(depth_reserve, budget):
        best = -1
        for c in range(child_lo[node + 1], child_hi[node + 1]):
            if score[c] > min_score and (best < 0 or score[c] > score[best]):
                best = c
        if best < 0:
            break
        chosen[best] = True
        taken += 1
        node = best
    # Then the best remaining (ties to the lower id). Neither scores nor reach grow from parent
    # to child and a parent's id is lower, so the kept set stays a tree with every parent kept.
    for node in _best(value[:n], score[:n], chosen, min_score, budget - taken):
        chosen[node] = True
        taken += 1
    remap = np.full(n, -1, dtype=np.int64)
    out_tok = np.empty(taken, dtype=np.int32)
    out_par = np.empty(taken, dtype=np.int32)
    out_src = np.empty(taken, dtype=np.uint8)
    out_score = np.empty(taken, dtype=np.float32)
    k = 0
    for node in range(n):
        if chosen[node]:
            remap[node] = k
            out_tok[k] = token[node]
            out_par[k] = remap[parent[node]] if parent[node] >= 0 else -1
            out_src[k] = source[node]
            out_score[k] = score[node]
            k += 1
    return out_tok, out_par, out_src, out_score, first_tok, first_val


@njit(cache=True, nogil=True, inline="always")
def _close_node(
    node: int,
    acc: np.ndarray,
    score: np.ndarray,
    source: np.ndarray,
    parent: np.ndarray,
    first_level: bool,
    token: np.ndarray,
    first_tok: np.ndarray,
    first_val: np.ndarray,
) -> None:
    """Score a finished node from its per-tier values (strongest tier as source, ties to the
    lower tier) and clear the buffer; a first-level node also competes for each tier's best
    first token. A score never exceeds the parent's (rows whose prefix probabilities grow are
    held to their prefix's), which keeps every kept node's parent kept."""
    total = 0.0
    best_t = 0
    for t in range(acc.size):
        total += acc[t]
        if acc[t] > acc[best_t]:
            best_t = t
    total = min(total, 1.0)
    p = parent[node]
    if p >= 0 and total > score[p]:
        total = score[p]
    score[node] = total
    source[node] = best_t
    for t in range(acc.size):
        if first_level and acc[t] > first_val[t]:
            first_val[t] = acc[t]
            first_tok[t] = token[node]
        acc[t] = 0.0


@njit(cache=True, nogil=True, inline="always")
def _sift_up(heap: np.ndarray, i: int) -> None:
    while i > 0:
        up = (i - 1) >> 1
        if heap[up] <= heap[i]:
            break
        heap[up], heap[i] = heap[i], heap[up]
        i = up


@njit(cache=True, nogil=True, inline="always")
def _sift_down(heap: np.ndarray, size: int) -> None:
    i = 0
    while True:
        low = i
        for c in (2 * i + 1, 2 * i + 2):
            if c < size and heap[c] < heap[low]:
                low = c
        if low == i:
            break
        heap[low], heap[i] = heap[i], heap[low]
        i = low


@njit(cache=True, nogil=True)
def stack_parts(
    rows_flat: np.ndarray, vals_flat: np.ndarray, meta: np.ndarray, confidence: np.ndarray, depth: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every tier's rows in one (R, depth) block, -1 padded, with each cell's value.

    Part ``p`` is ``meta[p] = (rows, width, per_cell, tier)``: that many rows of ``width``
    tokens, flattened in ``rows_flat``. With ``per_cell`` its values are per-prefix
    probabilities (``rows * width`` of them in ``vals_flat``), scaled by the confidence, and a
    node takes its best row; otherwise they are row weights (``rows`` of them), a node taking
    the weight share of its rows.
    """
    total = 0
    for p in range(meta.shape[0]):
        total += meta[p, 0]
    rows = np.full((total, depth), -1, dtype=np.int32)
    vals = np.zeros((total, depth))
    is_max = np.zeros(total, dtype=np.bool_)
    tiers = np.empty(total, dtype=np.int64)
    at, ro, vo = 0, 0, 0
    for p in range(meta.shape[0]):
        k, w, per_cell = meta[p, 0], meta[p, 1], meta[p, 2] != 0
        keep = min(w, depth)
        scale = confidence[p]
        if not per_cell:
            weight = 0.0
            for r in range(k):
                weight += vals_flat[vo + r]
            scale = scale / weight if weight > 0 else 0.0  # a tier with no weight adds nothing
        for r in range(k):
            for d in range(keep):
                rows[at + r, d] = rows_flat[ro + r * w + d]
            if per_cell:
                for d in range(keep):
                    vals[at + r, d] = vals_flat[vo + r * w + d] * scale
                is_max[at + r] = True
            else:
                vals[at + r, :] = vals_flat[vo + r] * scale
            tiers[at + r] = meta[p, 3]
        at += k
        ro += k * w
        vo += k * w if per_cell else k
    return rows, vals, is_max, tiers


@njit(cache=True, nogil=True)
def tree_buffers(cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Room for ``cap`` nodes of trees stored back to back: tokens, parents, sources, scores."""
    return (
        np.empty(cap, dtype=np.int32),
        np.empty(cap, dtype=np.int32),
        np.empty(cap, dtype=np.uint8),
        np.empty(cap, dtype=np.float32),
    )


@njit(cache=True, nogil=True)
def merge_batch(
    rows_flat: np.ndarray,
    vals_flat: np.ndarray,
    meta: np.ndarray,
    confidence: np.ndarray,
    part_offsets: np.ndarray,
    depth: np.ndarray,
    budget: np.ndarray,
    min_score: np.ndarray,
    depth_reserve: np.ndarray,
    n_tiers: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`stack_parts` then :func:`merge_tree` for many trees in one call. Tree ``j`` merges parts
    ``[part_offsets[j], part_offsets[j + 1])`` (laid out as :func:`stack_parts` reads them, one
    tree's after another's) under its own ``depth``, ``budget``, ``min_score`` and
    ``depth_reserve``.

    Returns the trees end to end ``(tokens, parents, sources, scores, tree_offsets)`` (tree
    ``j``: ``[tree_offsets[j], tree_offsets[j + 1])``, parents local to their tree) and each
    tree's per-tier best first token and value, ``(first_token, first_value)`` of shape
    ``(trees, n_tiers)``.
    """
    trees = part_offsets.size - 1
    cells = np.zeros(trees, dtype=np.int64)  # row cells per tree
    values = np.zeros(trees, dtype=np.int64)  # values per tree (one per cell, or one per row)
    for j in range(trees):
        for p in range(part_offsets[j], part_offsets[j + 1]):
            cells[j] += meta[p, 0] * meta[p, 1]
            values[j] += meta[p, 0] * meta[p, 1] if meta[p, 2] != 0 else meta[p, 0]
    cap = 0  # a tree holds at most its budget and at most one node per cell of its rows
    for j in range(trees):
        cap += max(0, min(budget[j], cells[j]))
    tokens, parents, sources, scores = tree_buffers(cap)
    offsets = np.zeros(trees + 1, dtype=np.int64)
    first_tok = np.full((trees, n_tiers), -1, dtype=np.int64)
    first_val = np.zeros((trees, n_tiers))
    ro, vo, at = 0, 0, 0
    unranked = no_calibration()
    for j in range(trees):
        p0, p1 = part_offsets[j], part_offsets[j + 1]
        if p1 > p0 and budget[j] > 0 and depth[j] > 0:
            rows, vals, is_max, tiers = stack_parts(
                rows_flat[ro : ro + cells[j]], vals_flat[vo : vo + values[j]], meta[p0:p1], confidence[p0:p1], depth[j]
            )
            tok, par, src, sc, ft, fv = merge_tree(
                rows, vals, is_max, tiers, n_tiers, budget[j], min_score[j], depth_reserve[j], unranked
            )
            k = tok.size
            tokens[at : at + k] = tok
            parents[at : at + k] = par
            sources[at : at + k] = src
            scores[at : at + k] = sc
            first_tok[j] = ft
            first_val[j] = fv
            at += k
        offsets[j + 1] = at
        ro += cells[j]
        vo += values[j]
    return tokens[:at], parents[:at], sources[:at], scores[:at], offsets, first_tok, first_val


@njit(cache=True, nogil=True)
def accepted_path(tokens: np.ndarray, parents: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Node indices of the longest root path of a tree equal to a prefix of ``target``."""
    path = np.empty(min(tokens.size, target.size), dtype=np.int64)
    node = -1
    depth = 0
    while depth < path.size:
        nxt = -1
        for i in range(tokens.size):
            if parents[i] == node and tokens[i] == target[depth]:
                nxt = i
                break
        if nxt < 0:
            break
        path[depth] = nxt
        node = nxt
        depth += 1
    return path[:depth]


@njit(cache=True, nogil=True)
def rejected_branches(
    tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, stop: int, limit: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``limit`` best-scoring children of node ``stop`` (-1: the root), each extended by
    its best-scoring descendants: ``(rows padded with -1, row lengths)``. Ties go to the lower
    node id.

    ``[[7, 9], [8, -1]]`` and ``[2, 1]`` for tokens ``[5, 7, 8, 9]``, parents
    ``[-1, 0, 0, 1]``, scores ``[.9, .5, .4, .3]`` and ``stop=0``.
    """
    n = tokens.size
    best_child = np.full(n + 1, -1, dtype=np.int64)  # slot 0 is the root
    kids = np.empty(n, dtype=np.int64)
    k = 0
    for i in range(n):  # parents precede children
        slot = parents[i] + 1
        b = best_child[slot]
        if b < 0 or scores[i] > scores[b]:
            best_child[slot] = i
        if parents[i] == stop:
            kids[k] = i
            k += 1
    chosen = _best(scores[kids[:k]], scores[kids[:k]], np.zeros(k, dtype=np.bool_), -np.inf, limit)
    width = 0
    for j in range(chosen.size):
        length, node = 1, kids[chosen[j]]
        while best_child[node + 1] >= 0:
            node = best_child[node + 1]
            length += 1
        width = max(width, length)
    out = np.full((chosen.size, width), -1, dtype=np.int32)
    lengths = np.ones(chosen.size, dtype=np.int64)
    for j in range(chosen.size):
        node, d = kids[chosen[j]], 0
        out[j, 0] = tokens[node]
        while best_child[node + 1] >= 0:
            node = best_child[node + 1]
            d += 1
            out[j, d] = tokens[node]
        lengths[j] = d + 1
    return out, lengths


@njit(cache=True, nogil=True)
def verification_outcome(
    tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, produced: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What verifying a tree produced: the accepted nodes (:func:`accepted_path`) and, when
    verification left the tree (``produced`` goes on past the path), the ``limit`` best
    branches it rejected there (:func:`rejected_branches`; none otherwise)."""
    path = accepted_path(tokens, parents, produced)
    if path.size >= produced.size or limit <= 0:
        return path, np.zeros((0, 0), dtype=np.int32), np.zeros(0, dtype=np.int64)
    rows, lengths = rejected_branches(tokens, parents, scores, path[-1] if path.size else -1, limit)
    return path, rows, lengths


@njit(cache=True, nogil=True)
def verification_outcomes(
    tokens: np.ndarray,
    parents: np.ndarray,
    scores: np.ndarray,
    sources: np.ndarray,
    tree_starts: np.ndarray,
    tree_ends: np.ndarray,
    produced: np.ndarray,
    produced_sizes: np.ndarray,
    limits: np.ndarray,
    width: int,
    n_tiers: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`verification_outcome` for many trees stored in shared arrays (tree ``j`` is
    ``[tree_starts[j], tree_ends[j])`` of them), each verified against the next
    ``produced_sizes[j]`` tokens of ``produced``, with up to ``limits[j]`` branches. Returns
    ``(path lengths, accepted nodes per source tier, branch rows cut to ``width`` and padded
    with -1, their lengths, each tree's first row)``."""
    n = tree_starts.size
    path_lengths = np.zeros(n, dtype=np.int64)
    by_tier = np.zeros(n_tiers, dtype=np.int64)
    total = 0
    for j in range(n):
        total += max(limits[j], 0)
    rows = np.full((total, width), -1, dtype=np.int32)
    lengths = np.zeros(total, dtype=np.int64)
    first_row = np.zeros(n + 1, dtype=np.int64)
    r = p0 = 0
    for j in range(n):
        t0, t1, p1 = tree_starts[j], tree_ends[j], p0 + produced_sizes[j]
        path, branch, kept = verification_outcome(
            tokens[t0:t1], parents[t0:t1], scores[t0:t1], produced[p0:p1], limits[j]
        )
        path_lengths[j] = path.size
        for i in range(path.size):
            by_tier[sources[t0 + path[i]]] += 1
        for k in range(kept.size):
            m = min(kept[k], width)
            rows[r, :m] = branch[k, :m]
            lengths[r] = m
            r += 1
        first_row[j + 1] = r
        p0 = p1
    return path_lengths, by_tier, rows[:r], lengths[:r], first_row

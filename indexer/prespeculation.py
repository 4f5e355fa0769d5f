"""Pre-speculation: drafting the next tree before verification of the current one ends.

Saguaro's idea applied to a drafting cache. Verifying a tree ends at some node ``v`` (possibly
the root): the target accepts the path to ``v`` and adds a bonus token ``b``, which under greedy
decoding is never one of ``v``'s children (a matching child would have been accepted). So while
the target verifies, the cache drafts one tree for each of the likeliest stopping points, at the
context extended by the path to ``v``, leaving out ``v``'s children. When verification reports
``path + [b]`` and that tree has a root child ``b``, the subtree under it is the next draft tree,
ready at once: one tree per stopping point covers every bonus token it proposes.

A chain is verified as a tree of one branch, so its stopping points are its tokens, each leaving
out only the one token the chain has after it: every other candidate the tiers and the
successor table hold for the bonus token is still in play there. Drafting ahead for a chain
takes those candidates (a one-level tree at the point) and drafts, for each, the chain the step
after that outcome would draft, its context extended by the point's path and the candidate.
They are sent as a fan (:func:`fan`): each candidate a root child with its chain below it, so
the outcome's bonus token selects the next chain as it selects a tree's subtree. And when the
target accepts every token proposed and its bonus token is the chain's next one, the rest of a
longer chain is the next draft (:func:`continue_chain`), ready at once as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from indexer import kernels
from indexer.tree_builder import DraftTree, TreeBatch

Prefetched = dict[tuple[int, ...], DraftTree]  # accepted draft tokens -> tree drafted after them


def stopping_points(tree: DraftTree, k: int) -> list[tuple[tuple[int, ...], frozenset[int]]]:
    """The ``k`` likeliest places verification of ``tree`` ends, best first, as ``(accepted
    draft tokens, tokens of that node's children)``.

    A node's score estimates the chance that it is accepted, so verification ends exactly at
    ``v`` with about ``score(v) - sum(score(children))`` (the root's score being 1).

    >>> t = DraftTree(np.array([5, 6, 9], np.int32), np.array([-1, 0, -1], np.int32),
    ...               np.zeros(3, np.uint8), np.array([0.8, 0.3, 0.1], np.float32))
    >>> [(path, sorted(kids)) for path, kids in stopping_points(t, 2)]  # 5 then stop: .5
    [((5,), [6]), ((5, 6), [])]
    """
    path_tokens, path_ends, kid_tokens, kid_ends = kernels.stopping_points(
        tree.tokens, tree.parents, np.ascontiguousarray(tree.scores, dtype=np.float32), k
    )
    paths, kids = path_tokens.tolist(), kid_tokens.tolist()
    out, p0, k0 = [], 0, 0
    for p1, k1 in zip(path_ends.tolist(), kid_ends.tolist(), strict=True):  # laid end to end
        out.append((tuple(paths[p0:p1]), frozenset(kids[k0:k1])))
        p0, k0 = p1, k1
    return out


def subtree(tree: DraftTree, token: int) -> DraftTree | None:
    """What ``tree`` drafted after its root child ``token``, re-rooted (``None`` if no such
    child).

    >>> t = DraftTree(np.array([5, 6, 7, 8], np.int32), np.array([-1, 0, 0, 1], np.int32),
    ...               np.zeros(4, np.uint8), np.ones(4, np.float32))
    >>> s = subtree(t, 5)
    >>> s.tokens.tolist(), s.parents.tolist()
    ([6, 7, 8], [-1, -1, 0])
    """
    found, idx, parents = kernels.subtree_nodes(tree.tokens, tree.parents, token)
    if not found:
        return None
    return DraftTree(tree.tokens[idx], parents, tree.sources[idx], tree.scores[idx])


def select(prefetched: Prefetched, produced: np.ndarray | Sequence[int]) -> DraftTree | None:
    """The tree drafted ahead for what verification ``produced`` (accepted draft tokens plus
    the bonus token), or ``None`` when no stopping point drafted for it."""
    produced = list(np.asarray(produced).tolist())
    if not produced:
        return None
    tree = prefetched.get(tuple(produced[:-1]))
    return None if tree is None else subtree(tree, produced[-1])


def continue_chain(chain: DraftTree, produced: np.ndarray | Sequence[int]) -> DraftTree | None:
    """What ``chain`` (a chain drafted for some context, scored with each token's chance of
    being reached) still holds once the context has grown by ``produced``, when those are its
    first tokens: the rest of it, each token's chance now given that the ones produced were
    right. ``None`` when the context left the chain or nothing of it is left.

    >>> c = DraftTree.chain(np.array([4, 5, 6, 7], np.int32))
    >>> c.scores[:] = [0.8, 0.4, 0.3, 0.1]
    >>> rest = continue_chain(c, [4, 5])
    >>> rest.tokens.tolist(), [round(float(s), 2) for s in rest.scores]
    ([6, 7], [0.75, 0.25])
    >>> continue_chain(c, [4, 9]) is None, continue_chain(c, [4, 5, 6, 7]) is None
    (True, True)
    """
    m = len(produced)
    if not 0 < m < len(chain) or not np.array_equal(chain.tokens[:m], np.asarray(produced, dtype=np.int32)):
        return None
    reached = float(chain.scores[m - 1])
    scores = chain.scores[m:] / reached if reached > 0 else chain.scores[m:]
    parents = np.arange(-1, len(chain) - m - 1, dtype=np.int32)
    return DraftTree(chain.tokens[m:], parents, chain.sources[m:], np.minimum(scores, 1.0).astype(np.float32))


def chain_stopping_points(reach: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` likeliest places verification of a chain ends, best first (ties: the shorter
    path), by ``reach`` (each token's chance of being accepted, never rising along the chain):
    how many of its tokens each accepts, and the chance verification ends exactly there.

    >>> n, chance = chain_stopping_points(np.array([0.6, 0.5, 0.1]), 3)
    >>> n.tolist(), [round(float(c), 2) for c in chance]
    ([0, 2, 3], [0.4, 0.4, 0.1])
    """
    r = np.concatenate(([1.0], np.asarray(reach, dtype=np.float64), [0.0]))
    stop = r[:-1] - r[1:]
    order = np.argsort(-stop, kind="stable")[: max(k, 0)]
    return order, stop[order]


def likeliest_outcomes(points: Sequence[tuple[float, DraftTree]], n: int) -> list[DraftTree]:
    """Of each stopping point's candidates for the bonus token (``(the point's chance, a
    one-level tree of them)``), those among the ``n`` likeliest outcomes in all, each point's
    best first: an outcome's chance is its point's times the candidate's share of the point's
    scores.

    >>> def one_level(tokens, scores):
    ...     return DraftTree(np.array(tokens, np.int32), np.full(len(tokens), -1, np.int32),
    ...                      np.zeros(len(tokens), np.uint8), np.array(scores, np.float32))
    >>> kept = likeliest_outcomes([(0.6, one_level([4, 5], [0.2, 0.6])), (0.3, one_level([7], [0.1]))], 2)
    >>> [t.tokens.tolist() for t in kept]  # .45 and .3 beat .15
    [[5], [7]]
    """
    chances = [c * t.scores / max(float(t.scores.sum()), 1e-12) for c, t in points]
    flat = np.concatenate(chances) if chances else np.zeros(0)
    keep = np.zeros(flat.size, dtype=bool)
    keep[np.argsort(-flat, kind="stable")[: max(n, 0)]] = True  # ties: the earlier point, then candidate
    out, at = [], 0
    for (_, tree), chance in zip(points, chances, strict=True):
        sel = np.flatnonzero(keep[at : at + chance.size])
        at += chance.size
        sel = sel[np.argsort(-tree.scores[sel], kind="stable")]
        out.append(DraftTree(tree.tokens[sel], tree.parents[sel], tree.sources[sel], tree.scores[sel]))
    return out


def fan(bonus: DraftTree, chains: TreeBatch, claims: np.ndarray) -> tuple[DraftTree, dict[int, np.ndarray]]:
    """One tree of the candidates for a bonus token, each followed by its chain: ``bonus``'s
    nodes (a one-level tree) are the root children, and chain ``r`` of ``chains`` goes under
    node ``r``. With it, by candidate, its chain's raw ``claims`` (laid out as the chains are).

    >>> bonus = DraftTree(np.array([5, 9], np.int32), np.array([-1, -1], np.int32),
    ...                   np.zeros(2, np.uint8), np.array([0.5, 0.2], np.float32))
    >>> chains = TreeBatch(np.array([6, 7], np.int32), np.array([-1, 0], np.int32), np.zeros(2, np.uint8),
    ...                    np.array([0.8, 0.6], np.float32), np.array([0, 2, 2]))
    >>> tree, by_bonus = fan(bonus, chains, np.array([0.9, 0.7]))
    >>> tree.tokens.tolist(), tree.parents.tolist(), {b: c.tolist() for b, c in by_bonus.items()}
    ([5, 6, 7, 9], [-1, 0, 1, -1], {5: [0.9, 0.7], 9: []})
    >>> select({(): tree}, [5]).tokens.tolist(), len(select({(): tree}, [9]))
    ([6, 7], 0)
    """
    n = len(bonus) + int(chains.offsets[-1] - chains.offsets[0])
    tokens, parents = np.empty(n, np.int32), np.empty(n, np.int32)
    sources, scores = np.empty(n, np.uint8), np.empty(n, np.float32)
    by_bonus: dict[int, np.ndarray] = {}
    ends, at = chains.offsets.tolist(), 0
    for r in range(len(bonus)):
        lo, hi = ends[r], ends[r + 1]
        tokens[at], parents[at], sources[at], scores[at] = bonus.tokens[r], -1, bonus.sources[r], bonus.scores[r]
        m = hi - lo
        tokens[at + 1 : at + 1 + m] = chains.tokens[lo:hi]
        parents[at + 1 : at + 1 + m] = np.arange(at, at + m, dtype=np.int32)  # a chain under its candidate
        sources[at + 1 : at + 1 + m] = chains.sources[lo:hi]
        scores[at + 1 : at + 1 + m] = chains.scores[lo:hi]
        by_bonus[int(bonus.tokens[r])] = claims[lo:hi]
        at += 1 + m
    return DraftTree(tokens, parents, sources, scores), by_bonus

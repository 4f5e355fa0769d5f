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
They are sent as a fan (:func:`fans`): each candidate a root child with its chain below it, so
the outcome's bonus token selects the next chain as it selects a tree's subtree. And when the
target accepts every token proposed and its bonus token is the chain's next one, the rest of a
longer chain is the next draft (:func:`continue_chain`), ready at once as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

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


class Outcomes(NamedTuple):
    """The outcomes kept for drafting chains ahead (:func:`likeliest_outcomes`): candidate
    indices point after point, where each point's end, and each candidate's context suffix."""

    kept: np.ndarray  # int64: indices into the candidates' batch
    kept_ends: np.ndarray  # int64 (points,)
    suffix_tokens: np.ndarray  # int32: the point's path, then the candidate, end to end
    suffix_ends: np.ndarray  # int64 (kept,)


def likeliest_outcomes(
    owner: np.ndarray,
    chances: np.ndarray,
    keep: np.ndarray,
    path_tokens: np.ndarray,
    path_ends: np.ndarray,
    candidates: TreeBatch,
) -> Outcomes:
    """Of each stopping point's candidates for the bonus token (point ``i``: session
    ``owner[i]``, a session's points consecutive; its chance ``chances[i]``; its path, end to
    end in ``path_tokens``; its candidates tree ``i`` of ``candidates``, one level), those among
    each session's ``keep[owner]`` likeliest outcomes, each point's best-scoring first. An
    outcome's chance is its point's times the candidate's share of the point's scores. With
    each, its context's suffix: the point's path and then the candidate.

    >>> candidates = TreeBatch(np.array([4, 5, 7], np.int32), np.full(3, -1, np.int32), np.zeros(3, np.uint8),
    ...                        np.array([0.2, 0.6, 0.1], np.float32), np.array([0, 2, 3]))
    >>> out = likeliest_outcomes(np.array([0, 0]), np.array([0.6, 0.3]), np.array([2]),
    ...                          np.array([9], np.int32), np.array([0, 1]), candidates)
    >>> out.kept.tolist(), out.kept_ends.tolist()  # .45 and .3 beat .15
    ([1, 2], [1, 2])
    >>> out.suffix_tokens.tolist(), out.suffix_ends.tolist()  # 5 at the chain's start, 7 after its 9
    ([5, 9, 7], [1, 3])
    """
    return Outcomes(
        *kernels.chain_outcomes(
            np.asarray(owner, dtype=np.int64),
            np.asarray(chances, dtype=np.float64),
            np.asarray(keep, dtype=np.int64),
            np.asarray(path_tokens, dtype=np.int32),
            np.asarray(path_ends, dtype=np.int64),
            candidates.tokens,
            candidates.scores,
            candidates.offsets,
        )
    )


def fans(bonus: TreeBatch, chains: TreeBatch) -> TreeBatch:
    """One tree per stopping point of the candidates kept there for the bonus token, each
    followed by its chain: point ``i``'s candidates (tree ``i`` of ``bonus``, one level) are
    its tree's root children, and chain ``r`` of ``chains`` goes under ``bonus``'s node ``r``.

    >>> bonus = TreeBatch(np.array([5, 9], np.int32), np.full(2, -1, np.int32), np.zeros(2, np.uint8),
    ...                   np.array([0.5, 0.2], np.float32), np.array([0, 2]))
    >>> chains = TreeBatch(np.array([6, 7], np.int32), np.array([-1, 0], np.int32), np.zeros(2, np.uint8),
    ...                    np.array([0.8, 0.6], np.float32), np.array([0, 2, 2]))
    >>> from indexer.tree_builder import DraftedTrees
    >>> (tree,) = DraftedTrees(fans(bonus, chains))
    >>> tree.tokens.tolist(), tree.parents.tolist()
    ([5, 6, 7, 9], [-1, 0, 1, -1])
    >>> select({(): tree}, [5]).tokens.tolist(), len(select({(): tree}, [9]))
    ([6, 7], 0)
    """
    tokens, parents, sources, scores, ends = kernels.chain_fans(
        bonus.offsets[1:],
        bonus.tokens,
        bonus.sources,
        bonus.scores,
        chains.tokens,
        chains.sources,
        chains.scores,
        chains.offsets,
    )
    return TreeBatch(tokens, parents, sources, scores, np.concatenate(([0], ends)))

"""Pre-speculation: drafting the next tree before verification of the current one ends.

Saguaro's idea applied to a drafting cache. Verifying a tree ends at some node ``v`` (possibly
the root): the target accepts the path to ``v`` and adds a bonus token ``b``, which under greedy
decoding is never one of ``v``'s children (a matching child would have been accepted). So while
the target verifies, the cache drafts one tree for each of the likeliest stopping points, at the
context extended by the path to ``v``, leaving out ``v``'s children. When verification reports
``path + [b]`` and that tree has a root child ``b``, the subtree under it is the next draft tree,
ready at once: one tree per stopping point covers every bonus token it proposes.

A chain needs no drafting ahead for its likeliest outcome: when the target accepts every token
proposed and its bonus token is the chain's next one, the rest of a longer chain is the next
draft (:func:`continue_chain`), ready at once as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from indexer import kernels
from indexer.tree_builder import DraftTree

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

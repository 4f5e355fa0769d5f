"""Adapters for servers that verify chains, not trees (vLLM's custom proposers, for one).

A chain is the tree's best path: from the root, always the child with the highest score
(the estimated probability that the node is accepted), at most ``k`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from decoder_client.client import ClientSession, DraftClient
from indexer.tree_builder import DraftTree


def best_chain(tree: DraftTree, max_len: int) -> np.ndarray:
    """The highest-scoring root path of ``tree``, at most ``max_len`` tokens.

    >>> t = DraftTree(np.array([5, 6, 7, 8], np.int32), np.array([-1, -1, 0, 0], np.int32),
    ...               np.zeros(4, np.uint8), np.array([0.9, 0.2, 0.3, 0.6], np.float32))
    >>> best_chain(t, 8).tolist()  # 5 (0.9) beats 6; under 5, 8 (0.6) beats 7
    [5, 8]
    """
    return tree.tokens[best_chain_nodes(tree, max_len)]


def best_chain_nodes(tree: DraftTree, max_len: int) -> np.ndarray:
    """The nodes of :func:`best_chain`, root first (their scores say how likely each is to be
    reached)."""
    parents, scores = tree.parents.tolist(), tree.scores.tolist()
    best: dict[int, int] = {}  # parent -> best child (ties: the earlier node)
    for i, p in enumerate(parents):
        if p not in best or scores[i] > scores[best[p]]:
            best[p] = i
    nodes: list[int] = []
    node = best.get(-1)
    while node is not None and len(nodes) < max_len:
        nodes.append(node)
        node = best.get(node)
    return np.array(nodes, dtype=np.int64)


class ChainProposer:
    """A proposer with the shape vLLM's custom proposers have: per step, the batch's request
    ids with the tokens each produced since its last step in, one chain of at most
    ``num_speculative_tokens`` tokens per request out.

    >>> proposer = ChainProposer(client, num_speculative_tokens=5)  # doctest: +SKIP
    >>> proposer.start("req-1", prompt_token_ids)  # doctest: +SKIP
    >>> proposer.propose({"req-1": [last_sampled_token]})  # doctest: +SKIP
    {'req-1': [464, 2068, 7586]}
    """

    def __init__(self, client: DraftClient, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self._client = client
        self._k = num_speculative_tokens
        self._sessions: dict[str, ClientSession] = {}

    def start(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        if req_id in self._sessions:
            raise ValueError(f"request {req_id!r} is already active")
        (self._sessions[req_id],) = self._client.open([prompt_token_ids])

    def propose(self, new_tokens: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """One batched draft call for every listed request."""
        unknown = [r for r in new_tokens if r not in self._sessions]
        if unknown:
            raise ValueError(f"unknown requests {unknown}: call start() first")
        ids = list(new_tokens)
        trees = self._client.draft([self._sessions[r] for r in ids], [new_tokens[r] for r in ids])
        return {r: best_chain(t, self._k).tolist() for r, t in zip(ids, trees, strict=True)}

    def finish(self, req_id: str, *, commit: bool = True) -> None:
        session = self._sessions.pop(req_id, None)
        if session is not None:
            self._client.close([session], commit=commit)

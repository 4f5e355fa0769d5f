"""Attention mask and position ids that let a causal LM score a whole draft tree in one forward.

The query block is ``[root, node 0, ..., node n-1]``: the root is the last accepted token (not
yet in the KV cache) and the nodes are a :class:`~indexer.tree_builder.DraftTree` in wire order
(parents precede children, parent -1 is the root). Each query attends to the whole past, the
root, and its own ancestors (itself included), and sits at position ``past_len + depth`` (the
root has depth 0), so every node sees exactly what it would see had its root path been decoded
one token at a time. The mask is additive (0 where allowed, the dtype's most negative value
elsewhere), the 4D form Hugging Face models take as-is and every attention backend accepts.
"""

from __future__ import annotations

import numpy as np
import torch


def check_parents(parents: np.ndarray) -> None:
    """Raise ``ValueError`` unless ``parents`` is int32 (n,) with ``-1 <= parents[i] < i``.

    >>> check_parents(np.array([-1, 0, -1], dtype=np.int32))
    >>> check_parents(np.array([0], dtype=np.int32))
    Traceback (most recent call last):
    ...
    ValueError: parents must satisfy -1 <= parents[i] < i
    """
    if parents.dtype != np.int32 or parents.ndim != 1:
        raise ValueError(f"parents must be a 1-D int32 array, got {parents.dtype} with shape {parents.shape}")
    if parents.size and (parents.min() < -1 or np.any(parents >= np.arange(parents.size))):
        raise ValueError("parents must satisfy -1 <= parents[i] < i")


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """Boolean (n+1, n+1) matrix over ``[root, nodes...]``: ``[q, k]`` iff k is q or an ancestor.

    >>> ancestor_matrix(np.array([-1, 0, -1], dtype=np.int32)).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    """
    check_parents(parents)
    n = parents.size
    anc = np.zeros((n + 1, n + 1), dtype=bool)
    anc[0, 0] = True
    for i, p in enumerate(parents.tolist()):
        anc[i + 1] = anc[p + 1]  # the parent's row (the root's when p == -1) ...
        anc[i + 1, i + 1] = True  # ... plus the node itself
    return anc


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of ``[root, nodes...]`` (int64 (n+1,)), the root at 0.

    >>> tree_depths(np.array([-1, 0, -1, 1], dtype=np.int32)).tolist()
    [0, 1, 2, 1, 3]
    """
    return ancestor_matrix(parents).sum(axis=1) - 1


def tree_position_ids(parents: np.ndarray, past_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position ids (1, n+1) of the query block: ``past_len + depth``.

    >>> tree_position_ids(np.array([-1, 0, -1], dtype=np.int32), past_len=5).tolist()
    [[5, 6, 7, 6]]
    """
    if past_len < 0:
        raise ValueError(f"past_len must be >= 0, got {past_len}")
    depths = torch.from_numpy(tree_depths(parents))
    return (depths + past_len).unsqueeze(0).to(device=device, dtype=torch.long)


def tree_attention_mask(
    parents: np.ndarray,
    past_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Additive mask (1, 1, n+1, past_len+n+1): 0 where a query may attend, ``finfo.min`` elsewhere.

    >>> m = tree_attention_mask(np.array([-1, -1], dtype=np.int32), past_len=1)
    >>> (m[0, 0] == 0).int().tolist()  # two siblings: each sees the past, the root and itself
    [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    """
    if past_len < 0:
        raise ValueError(f"past_len must be >= 0, got {past_len}")
    anc = torch.from_numpy(ancestor_matrix(parents))
    allowed = torch.ones(anc.shape[0], past_len + anc.shape[1], dtype=torch.bool)
    allowed[:, past_len:] = anc
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)

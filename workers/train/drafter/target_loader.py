"""The frozen target the drafter trains and is evaluated on: an HF causal LM and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workers.target_heads import moved


def load_target(path: str | Path, device: torch.device | str | None = None) -> tuple[Any, Any]:
    """An HF causal LM (eval mode) and its tokenizer from ``path``, on ``device``: on a GPU in
    bf16 (the target's features stay in it; 2 bytes a weight), elsewhere in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = torch.device(device) if device is not None else torch.device("cpu")
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=None)
    return moved(model, where).eval(), tokenizer

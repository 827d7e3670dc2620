"""The frozen target the drafter trains and is evaluated on: an HF causal LM and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_target(path: str | Path) -> tuple[Any, Any]:
    """An HF causal LM (eval mode, float32) and its tokenizer from ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer

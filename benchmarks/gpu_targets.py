"""The random targets ``gpu_check.py`` runs on: dense Qwen3-8B, hybrid Qwen3.6-27B, tiny twins.

    target = build_target("qwen3.6-27b", tiny=False, device=torch.device("cuda"), layers=16)
    print(describe("qwen3.6-27b"), linear_attention_kernels())

Qwen3.6-27B's shape is read from ``benchmarks/shapes/qwen3.6-27b.json`` (its model card's
``text_config``; a copy of the shared shape file) into transformers' ``Qwen3_5TextConfig``; its
64 layers are cut to ``layers`` (a multiple of 4, 16 by default: about 17 GB in bf16) so the
target, extraction and training fit one GPU, keeping the 3 linear : 1 full attention pattern.
The tiny hybrid keeps the pattern at the tiny model's widths for the CPU smoke run.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

SHAPES = Path(__file__).resolve().parent / "shapes"
DENSE, HYBRID = "qwen3-8b", "qwen3.6-27b"
TARGETS = (DENSE, HYBRID)
PATTERN = 4   # Qwen3.6: every 4th layer is full attention (3 Gated DeltaNet : 1 Gated Attention)

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                max_position_embeddings=40960, tie_word_embeddings=False)
TINY = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=384, vocab_size=6008, max_position_embeddings=4096,
            tie_word_embeddings=True)   # as embedded/tinybuild.py builds the tiny model
TINY_HYBRID = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=384, vocab_size=6016,
                   max_position_embeddings=262144, linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                   tie_word_embeddings=False)
# Qwen3Config/Qwen3_5TextConfig fields of the shape file; the rest describe, not configure.
_HYBRID_FIELDS = ("hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "tie_word_embeddings")


def qwen36_text(layers: int) -> dict[str, Any]:
    """Qwen3.6-27B's ``text_config`` settings with ``layers`` layers of its 3:1 pattern."""
    if layers < PATTERN or layers % PATTERN:
        raise ValueError(f"--layers must be a multiple of {PATTERN} (3 linear : 1 full), "
                         f"not {layers}")
    text = json.loads((SHAPES / f"{HYBRID}.json").read_text())["text_config"]
    settings = {k: text[k] for k in _HYBRID_FIELDS}
    rotary = text["rotary_dim"] / text["head_dim"]   # 64 of 256: partial rotary
    return settings | dict(num_hidden_layers=layers, rope_parameters={
        "rope_theta": float(text["rope_theta"]), "partial_rotary_factor": rotary,
        "rope_type": "default"})


def _layer_types(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % PATTERN == 0 else "linear_attention"
            for i in range(layers)]


def target_config(name: str, tiny: bool, layers: int | None = None) -> Any:
    """The transformers config of ``name`` (full size or the tiny twin)."""
    if name == DENSE:
        from transformers import Qwen3Config

        return Qwen3Config(**(TINY if tiny else QWEN3_8B), rms_norm_eps=1e-6,
                           rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"})
    if name != HYBRID:
        raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    from transformers import Qwen3_5TextConfig

    if tiny:
        settings = TINY_HYBRID | dict(rope_parameters={
            "rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_type": "default"})
    else:
        settings = qwen36_text(layers or 16)
    count = settings["num_hidden_layers"]
    return Qwen3_5TextConfig(**settings, layer_types=_layer_types(count), rms_norm_eps=1e-6)


def build_target(name: str, tiny: bool, device: torch.device, layers: int | None = None) -> Any:
    """A random target of the chosen shape, initialised on ``device`` in its compute dtype."""
    from transformers import AutoModelForCausalLM

    config = target_config(name, tiny, layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def describe(name: str, tiny: bool, layers: int | None = None) -> str:
    """What the title line calls the target."""
    if tiny:
        return f"tiny {'hybrid (3 linear : 1 full)' if name == HYBRID else 'dense'}"
    if name == DENSE:
        return "Qwen3-8B shape"
    return f"Qwen3.6-27B text_config, {layers or 16} of 64 layers (3 linear : 1 full)"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:   # a broken CUDA extension raises anything on import
        return False
    return True


def linear_attention_kernels() -> str:
    """Which Gated DeltaNet kernels transformers picks here (it falls back to torch per op)."""
    delta = "flash-linear-attention" if _importable("fla") else "torch fallback"
    conv = "causal-conv1d" if _importable("causal_conv1d") else "torch fallback"
    return f"delta rule: {delta}, conv: {conv}"

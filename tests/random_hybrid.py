"""A small random hybrid target (Qwen3.5 family: Gated DeltaNet and full attention, 3:1) on disk.

Stands in for the embedded ``tiny-qwen3.5`` where a test needs a hybrid's cache and layer
kinds, not sensible replies: it shares the tiny model's tokenizer, so prompts render alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LAYERS = 8
INIT_STD = 0.1   # wide enough that greedy decoding does not settle on one token


def build_random_hybrid(dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a seeded random ``Qwen3_5ForCausalLM`` and ``tokenizer_dir``'s tokenizer to
    ``dest``."""
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if (dest / "config.json").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, dest / name)
    generation = GenerationConfig.from_pretrained(tokenizer_dir)
    vocab = int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=96, intermediate_size=192, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=True,
        initializer_range=INIT_STD,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(LAYERS)],
        bos_token_id=generation.bos_token_id, pad_token_id=generation.pad_token_id,
        eos_token_id=generation.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config).eval()
    model.generation_config = generation
    model.save_pretrained(dest, safe_serialization=True)
    return dest

"""The drafter's shape: its layers, heads, block, the target layers it reads and its mask token.

``DFlashConfig.from_target`` copies the target's layer shape (the drafter shares its embedding
and head); published shapes apply on top (:mod:`workers.train.drafter.shape`). Layer types are
``full_attention`` or ``sliding_attention`` as SGLang's DFLASH reads them (see
:mod:`workers.train.drafter.masks` for the window rule).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import Qwen3Config

from common.drafter.layers import dflash_layer_ids
from common.engine.target import TargetShape
from common.runs.options import DRAFTER_LAYERS

log = logging.getLogger(__name__)

# SGLang's DFLASH worker looks this token up (or adds it) when the config has no mask_token_id.
MASK_TOKEN = "<|MASK|>"
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class DFlashConfig:
    """Drafter shape, the target it reads from, and the DFlash block settings."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_hidden_layers: int = 5
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    attention_bias: bool = False
    initializer_range: float = 0.02
    mask_token: str = MASK_TOKEN
    layer_types: tuple[str, ...] | None = None   # None: every layer full_attention
    sliding_window: int | None = None            # keys per sliding query, its own included
    is_causal: bool | None = None                # None: per layer type, as SGLang's DFLASH

    def __post_init__(self) -> None:
        for name in ("target_layer_ids", "layer_types"):   # JSON gives lists
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        types = self.layer_types
        if types is not None:
            if len(types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(types)} entries for "
                                 f"{self.num_hidden_layers} layers (num_hidden_layers)")
            unknown = sorted(set(types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types {unknown} unknown: a DFlash layer is "
                                 f"{' or '.join(LAYER_TYPES)}")
            if SLIDING not in types:   # one spelling of "every layer full"
                object.__setattr__(self, "layer_types", types := None)
        if types is None:
            object.__setattr__(self, "sliding_window", None)
        elif self.sliding_window is None or self.sliding_window < 1:
            raise ValueError(f"sliding_attention layers need a positive sliding_window, not "
                             f"{self.sliding_window}")

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL

    def attention_kind(self, index: int) -> tuple[int | None, bool]:
        """``(window, causal)`` of layer ``index``: what its attention mask depends on."""
        sliding = self.layer_type(index) == SLIDING
        causal = sliding if self.is_causal is None else self.is_causal
        return (self.sliding_window if sliding else None), causal

    @property
    def attention_kinds(self) -> tuple[tuple[int | None, bool], ...]:
        """The distinct kinds of the layers, in layer order (one mask each)."""
        return tuple(dict.fromkeys(self.attention_kind(i)
                                   for i in range(self.num_hidden_layers)))

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def context_dim(self) -> int:
        """Width of the concatenated target features, ``K * H``."""
        return self.num_context_features * self.hidden_size

    @classmethod
    def from_target(cls, target_config: Any, mask_token_id: int, *,
                    num_hidden_layers: int = DRAFTER_LAYERS,
                    block_size: int = 16, num_features: int = 5,
                    layer_ids: Sequence[int] | None = None) -> DFlashConfig:
        """Copy the target's layer shape; read ``layer_ids`` (default: ``num_features`` layers
        of the DFlash spread)."""
        shape = TargetShape.of(target_config)
        heads = shape.num_attention_heads
        if heads is None or shape.intermediate_size is None:
            raise ValueError(f"target {shape.model_type or '?'} states no attention heads or MLP "
                             "width for the drafter to copy")
        if shape.rope_type != "default":
            log.warning("target uses rope_type=%s; the drafter uses default RoPE", shape.rope_type)
        return cls(
            hidden_size=shape.hidden_size, num_attention_heads=heads,
            num_key_value_heads=shape.num_key_value_heads or heads,
            head_dim=shape.head_dim or shape.hidden_size // heads,
            intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
            num_target_layers=shape.num_layers,
            target_layer_ids=tuple(layer_ids or dflash_layer_ids(shape.num_layers, num_features)),
            mask_token_id=mask_token_id, num_hidden_layers=num_hidden_layers,
            block_size=block_size, rms_norm_eps=shape.rms_norm_eps,
            rope_theta=shape.rope_theta or 1_000_000.0,
            max_position_embeddings=shape.context_length or 40960,
            hidden_act=shape.hidden_act, attention_bias=shape.attention_bias,
        )

    def qwen3_config(self) -> Qwen3Config:
        """The equivalent transformers config, to build Qwen3 blocks (MLP, RoPE) from."""
        return Qwen3Config(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            num_hidden_layers=self.num_hidden_layers, rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            max_position_embeddings=self.max_position_embeddings, hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
        )

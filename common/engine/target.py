"""One reader of a target model's settings, dense (Qwen3) or hybrid (Qwen3.5/3.6 family).

    shape = TargetShape.from_dir(model_dir)          # reads config.json only: no torch
    shape = TargetShape.of(model.config)             # a loaded HF config
    shape.hidden_size, shape.num_layers, shape.is_hybrid, shape.full_attention_layers

A multimodal checkpoint (``Qwen3_5ForConditionalGeneration``) nests the language model's
settings under ``text_config``; every stage and command reads them through this module and no
other code reads ``config.json`` keys of a target.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.errors import ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions")
# Where a config states the checkpoint's own MTP head: Qwen3.5/3.6 and Qwen3-Next
# (``mtp_num_hidden_layers``); MiMo, DeepSeek-V3 and GLM-4.5 (``num_nextn_predict_layers``).
MTP_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp")
NO_MTP_HEAD = ("the target states no MTP head (text_config.mtp_num_hidden_layers or "
               "num_nextn_predict_layers)")
NO_MTP_WEIGHTS = ("the target's config states an MTP head but its weights hold none (no mtp.* "
                  "tensor, nor a layer past num_hidden_layers, in {where})")
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def weight_names(model_dir: Path) -> tuple[list[str], str] | None:
    """The tensor names a checkpoint's files list (its index, else the single file's header)
    and which file said so; None where there is neither (a config-only directory)."""
    index = model_dir / INDEX_FILE
    try:
        if index.is_file():
            names = json.loads(index.read_text()).get("weight_map", {})
            return list(names) if isinstance(names, dict) else [], INDEX_FILE
        single = model_dir / SINGLE_FILE
        if single.is_file():
            with single.open("rb") as f:   # the header: 8 bytes of length, then JSON
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(min(size, 100 * 2**20)))
            return [k for k in header if k != "__metadata__"], SINGLE_FILE
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{model_dir}: cannot list the weights' tensors: {exc}") from None
    return None


def head_in_weights(names: list[str], num_layers: int) -> bool:
    """Whether tensor ``names`` hold an MTP head: Qwen3.5/3.6's ``mtp.*``, MiMo's
    ``model.mtp_layers.*``, or DeepSeek-V3/GLM-4.5's extra layers past ``num_hidden_layers``."""
    for name in names:
        if name.startswith("mtp.") or ".mtp" in name or "mtp_layers" in name:
            return True
        match = _LAYER.search(name)
        if match is not None and int(match.group(1)) >= num_layers:
            return True
    return False


def _text_settings(data: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: ``text_config`` when nested, else the config itself."""
    nested = data.get("text_config")
    return {**data, **nested} if isinstance(nested, dict) else data


def _rope_theta(text: dict[str, Any]) -> float | None:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = text.get("rope_theta", theta)
    return float(theta) if isinstance(theta, int | float) else None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _layer_shape(text: dict[str, Any], hidden: int) -> dict[str, Any]:
    """Heads, head dim, MLP width, norm eps, activation, bias and rope type, where stated."""
    heads = _int_or_none(text.get("num_attention_heads"))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    eps = text.get("rms_norm_eps")
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=_int_or_none(text.get("num_key_value_heads")) or heads,
        head_dim=_int_or_none(text.get("head_dim")) or (hidden // heads if heads else None),
        intermediate_size=_int_or_none(text.get("intermediate_size")),
        rms_norm_eps=float(eps) if isinstance(eps, int | float) else 1e-6,
        hidden_act=str(text.get("hidden_act") or "silu"),
        attention_bias=bool(text.get("attention_bias", False)),
        rope_type=str(rope_type or "default"),
    )


def _default_layer_types(data: dict[str, Any], text: dict[str, Any], layers: int) -> list[str]:
    """What transformers derives when ``layer_types`` is absent: for the Qwen3.5/Qwen3-Next
    family every ``full_attention_interval``-th layer (default 4) is full attention."""
    if not str(data.get("model_type", "")).startswith(("qwen3_5", "qwen3_next")):
        return [FULL_ATTENTION] * layers
    every = int(text.get("full_attention_interval", 4))
    return [LINEAR_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(layers)]


@dataclass(frozen=True)
class TargetShape:
    """What the pipeline needs to know of a target: sizes, layer kinds, context, dtype."""

    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    context_length: int | None
    dtype: str | None
    tie_word_embeddings: bool
    rope_theta: float | None
    has_mtp: bool = False
    mtp_missing: str = ""   # why a head the config states is not taken (its weights lack it)
    # The attention and MLP shape of a full-attention layer (a drafter copies it).
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_type: str = "default"

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> TargetShape:
        """Parse a ``config.json`` dict (nested ``text_config`` or flat)."""
        text = _text_settings(data)
        try:
            hidden, layers, vocab = (int(text[k]) for k in
                                     ("hidden_size", "num_hidden_layers", "vocab_size"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where} lacks or garbles a model size field: {exc!r}") from None
        types = text.get("layer_types") or _default_layer_types(data, text, layers)
        if len(types) < layers:
            raise ConfigError(f"{where}: layer_types names {len(types)} layers, "
                              f"num_hidden_layers is {layers}")
        context = next((text[k] for k in CONTEXT_KEYS if isinstance(text.get(k), int)), None)
        dtype = text.get("dtype") or text.get("torch_dtype") or data.get("dtype") \
            or data.get("torch_dtype")
        tied = data.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            model_type=str(data.get("model_type", text.get("model_type", ""))),
            architectures=tuple(data.get("architectures") or ()),
            hidden_size=hidden, num_layers=layers, layer_types=tuple(types[:layers]),
            vocab_size=vocab, context_length=context,
            dtype=str(dtype) if isinstance(dtype, str) else None,
            tie_word_embeddings=bool(tied), rope_theta=_rope_theta(text),
            has_mtp=any(text.get(k) for k in MTP_KEYS),
            **_layer_shape(text, hidden),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TargetShape:
        """The shape stated by ``model_dir/config.json``."""
        path = Path(model_dir) / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{model_dir} has no config.json") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is not readable JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} is not a JSON object")
        shape = cls.from_dict(data, str(path))
        listed = weight_names(Path(model_dir)) if shape.has_mtp else None
        if listed is not None and not head_in_weights(listed[0], shape.num_layers):
            return replace(shape, has_mtp=False,
                           mtp_missing=NO_MTP_WEIGHTS.format(where=listed[1]))
        return shape

    @classmethod
    def of(cls, config: Any) -> TargetShape:
        """The shape of a loaded HF ``PretrainedConfig`` (or of a model: its ``.config``)."""
        config = getattr(config, "config", config)
        return cls.from_dict(config.to_dict(), type(config).__name__)

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention (Gated DeltaNet): state, not a KV cache."""
        return LINEAR_ATTENTION in self.layer_types

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

"""What the training memory plan reads of a target and a drafter: sizes, no weights.

    target = TargetDims.load("benchmarks/shapes/qwen3.6-27b.json")   # or a model dir, config.json
    drafter = DrafterDims.of(target.shape, overrides, layer_ids)       # the run's drafter shape
    target.params, drafter.params, drafter.layer_params
    target.trunk_params(61)       # layers 0..60: what a capture stopping after layer 60 multiplies

A target's parameter count is what transformers builds from its config on the meta device (the
model ``AutoModelForCausalLM`` loads for training: no vision tower, no MTP head), so every family
transformers knows is counted exactly; where it cannot build one, the weights' own files say
(``model.safetensors.index.json``'s total size). A drafter is our own model: its count is
computed from its shape (:class:`DrafterDims`), checked against a built drafter in the tests.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.drafter.layers import dflash_layer_ids
from common.engine.target import TargetShape
from common.errors import ConfigError
from common.runs.options import DRAFTER_LAYERS

log = logging.getLogger(__name__)

BLOCK_SIZE = 16   # DFlash's block (a drafter config may say otherwise)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


def read_config(source: str | Path) -> tuple[dict[str, Any], Path | None]:
    """A target's config as a dict, from a model directory, a config.json or a shape file
    (``_``-prefixed fields are notes); and the model directory when there is one."""
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such model directory, config.json or shape file") \
            from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: not a JSON object")
    return {k: v for k, v in data.items() if not k.startswith("_")}, (
        path if path.is_dir() else None)


@dataclass(frozen=True)
class LinearDims:
    """A hybrid target's linear-attention (Gated DeltaNet) widths, as its config (or the
    library's defaults for its family) states them."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def conv_width(self) -> int:
        """Channels of the causal convolution over q, k and v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @classmethod
    def of(cls, hf_config: Any) -> LinearDims | None:
        """From a transformers config (its ``text_config`` when nested); None without one."""
        text = getattr(hf_config, "text_config", None) or hf_config
        values = [getattr(text, f"linear_{name}", None) for name in
                  ("num_key_heads", "key_head_dim", "num_value_heads", "value_head_dim")]
        ints = [v for v in values if isinstance(v, int)]
        return cls(*ints) if len(ints) == len(values) else None


def layer_counts(model: Any) -> tuple[int, ...]:
    """Each decoder layer's parameters, in order (empty where no module holds a ``layers``
    list: the trunk is the first module that does, as :mod:`workers.capture` finds it)."""
    from torch import nn

    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    return ()


def meta_model(config: dict[str, Any]) -> tuple[int, LinearDims | None, tuple[int, ...]]:
    """Parameters of the causal LM transformers builds from ``config`` (on the meta device),
    its linear-attention widths with the library's defaults filled in, and each decoder layer's
    parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (KeyError, ValueError, TypeError, ImportError) as exc:
        raise ConfigError(f"transformers cannot build a {config.get('model_type')!r} causal LM "
                          f"from this config ({exc})") from None
    return (sum(p.numel() for p in model.parameters()), LinearDims.of(hf_config),
            layer_counts(model))


def file_parameters(model_dir: Path, dtype_bytes: int) -> int:
    """Parameters the checkpoint's files hold (all of them: a vision tower, an MTP head too)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if isinstance(total, int):
            return total // dtype_bytes
    files = list(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no safetensors weights to count")
    return sum(f.stat().st_size for f in files) // dtype_bytes


@dataclass(frozen=True)
class TargetDims:
    """A target's shape and parameter count, and the dtype it is loaded in."""

    shape: TargetShape
    params: int
    dtype_bytes: int = 2   # bf16 on a GPU (the checkpoint's own dtype); 4: float32 on the CPU
    source: str = ""
    linear: LinearDims | None = None   # a hybrid's Gated DeltaNet widths
    layer_params: tuple[int, ...] = ()  # each decoder layer's (empty: counted from the files)

    @classmethod
    def of_model(cls, model: Any) -> TargetDims:
        """A loaded model's own figures (its parameters, dtype and config)."""
        weight = next(iter(model.parameters()))
        return cls(TargetShape.of(model.config), sum(p.numel() for p in model.parameters()),
                   weight.element_size(), type(model).__name__, LinearDims.of(model.config),
                   layer_counts(model))

    @classmethod
    def load(cls, source: str | Path) -> TargetDims:
        """From a model directory, a config.json or a shape file (no weights are read)."""
        config, model_dir = read_config(source)
        shape = TargetShape.from_dict(config, str(source))
        stated = DTYPE_BYTES.get(shape.dtype or "", 2)
        linear: LinearDims | None = None
        layers: tuple[int, ...] = ()
        try:
            params, linear, layers = meta_model(config)
        except ConfigError as exc:
            if model_dir is None:
                raise
            log.info("%s; counting the weights' files instead", exc)
            params = file_parameters(model_dir, stated)
        return cls(shape, params, 2, str(source), linear, layers)

    def trunk_params(self, layers: int) -> int:
        """Parameters of decoder layers ``0..layers-1``: the weights a forward that stops after
        them multiplies (without per-layer counts: all but the embedding and an untied LM head,
        shared evenly)."""
        if len(self.layer_params) == self.shape.num_layers:
            return sum(self.layer_params[:layers])
        shape = self.shape
        heads = 1 if shape.tie_word_embeddings else 2
        body = max(0, self.params - heads * shape.vocab_size * shape.hidden_size)
        return body * min(layers, shape.num_layers) // shape.num_layers

    def on(self, dtype_bytes: int) -> TargetDims:
        """The same target loaded in another dtype (float32 on the CPU)."""
        return replace(self, dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class DrafterDims:
    """A DFlash drafter's shape: what its parameters, activations and FLOPs depend on."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_features: int          # K target layers read
    block_size: int = BLOCK_SIZE
    attention_bias: bool = False
    deepest_layer: int | None = None   # the deepest target layer read (None: the last)

    @classmethod
    def of(cls, target: TargetShape, overrides: dict[str, Any] | None = None,
           layer_ids: Sequence[int] | None = None) -> DrafterDims:
        """The drafter the target alone gives (its layer shape, ``DRAFTER_LAYERS`` layers, the
        DFlash spread of 5 layers), with a drafter config's checked fields (``overrides``, as
        :func:`common.drafter.shape.checked_shape` gives them) applied."""
        heads = target.num_attention_heads
        if heads is None or target.intermediate_size is None:
            raise ConfigError(f"target {target.model_type or '?'} states no attention heads or "
                              "MLP width for the drafter to copy")
        shape = overrides or {}
        ids = shape.get("dflash.target_layer_ids") or layer_ids or dflash_layer_ids(
            target.num_layers, 5)
        return cls(
            hidden_size=target.hidden_size,
            num_hidden_layers=int(shape.get("num_hidden_layers", DRAFTER_LAYERS)),
            num_attention_heads=int(shape.get("num_attention_heads", heads)),
            num_key_value_heads=int(shape.get("num_key_value_heads",
                                              target.num_key_value_heads or heads)),
            head_dim=int(shape.get("head_dim", target.head_dim or target.hidden_size // heads)),
            intermediate_size=int(shape.get("intermediate_size", target.intermediate_size)),
            vocab_size=target.vocab_size, num_features=len(ids),
            block_size=int(shape.get("block_size", BLOCK_SIZE)),
            attention_bias=bool(shape.get("attention_bias", target.attention_bias)),
            deepest_layer=max(int(i) for i in ids))

    @classmethod
    def from_config(cls, config: Any) -> DrafterDims:
        """From a built drafter's config (``DFlashConfig``: the same field names)."""
        return cls(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                   config.num_key_value_heads, config.head_dim, config.intermediate_size,
                   config.vocab_size, len(config.target_layer_ids), config.block_size,
                   config.attention_bias, max(int(i) for i in config.target_layer_ids))

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder layer: q/k/v/o projections, q/k norms, two norms, the gated MLP."""
        h, bias = self.hidden_size, int(self.attention_bias)
        attention = (h * self.q_width + 2 * h * self.kv_width + self.q_width * h
                     + bias * (self.q_width + 2 * self.kv_width + h) + 2 * self.head_dim)
        return attention + 2 * h + 3 * h * self.intermediate_size

    @property
    def params(self) -> int:
        """Trainable parameters: the layers, the feature projection ``K*H -> H`` and two norms
        (the embedding and LM head are the target's, frozen and shared)."""
        h = self.hidden_size
        return self.num_hidden_layers * self.layer_params + self.num_features * h * h + 2 * h

"""A drafter's shape from a published DFlash ``config.json`` (``--drafter-config``), applied.

The file is read and checked, torch-free, by :mod:`common.drafter.shape` (enqueue checks it
there too); here its fields are applied to the drafter the target alone gives.

    overrides = read_shape("qwen3.5-27b-dflash.json")            # checked, target-free
    config = shaped_config(base, overrides, target_shape)         # base: DFlashConfig.from_target
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from common.drafter.shape import (  # noqa: F401 - re-exported: the trainer's one import
    DrafterShapeError,
    check_target,
    checked_shape,
    read_shape,
)
from common.engine.target import TargetShape
from workers.train.drafter.config import DFlashConfig


def shaped_config(base: DFlashConfig, shape: dict[str, Any],
                  target: TargetShape) -> DFlashConfig:
    """``base`` (the drafter the target alone gives) with the file's fields; checked against the
    target. Raises :class:`DrafterShapeError` naming the first field that cannot hold."""
    check_target(shape, target)
    ids = shape.get("dflash.target_layer_ids")
    mask = shape.get("dflash.mask_token_id")
    if mask is not None and mask != base.mask_token_id:
        raise DrafterShapeError(f"drafter config: dflash_config.mask_token_id: {mask} != the "
                                f"target tokenizer's mask token id {base.mask_token_id}")
    values = {k: v for k, v in shape.items() if "." not in k}
    if ids is not None:
        values["target_layer_ids"] = tuple(ids)
    if "layer_types" not in values and "num_hidden_layers" in values:
        values["layer_types"] = None
    try:
        return replace(base, **values)
    except ValueError as exc:
        raise DrafterShapeError(f"drafter config: {exc}") from None


def differences(run: DFlashConfig, wanted: DFlashConfig) -> list[str]:
    """Fields of a run's drafter (its checkpoint) that a drafter config would change."""
    return [name for name in ("num_hidden_layers", "layer_types", "sliding_window", "is_causal",
                              "num_attention_heads", "num_key_value_heads", "head_dim",
                              "intermediate_size", "block_size", "target_layer_ids")
            if getattr(run, name) != getattr(wanted, name)]

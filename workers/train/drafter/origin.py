"""A run's new drafter, shaped as its run.json says: the target's own shape (the default), a
published shape (``--drafter-config``), or a released drafter's weights and shape
(``--init-drafter``), all frozen at enqueue (:mod:`common.drafter.origin`).

    drafter = new_drafter(target, mask_id, layers, config.drafter)   # on the target's device

A released drafter is a directory as ``export-drafter`` writes and z-lab publishes:
``config.json`` and safetensors weights named as SGLang loads them (``layers.N.self_attn...``,
``fc.weight``, ``hidden_norm.weight``, ``norm.weight``); an embedding or LM head in the file is
the target's and is not loaded. Its target layers and mask token must be the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.choices import OriginKind
from common.drafter.origin import DrafterOrigin, describe_origin, verify_weights
from common.drafter.shape import DrafterShapeError
from common.engine.target import TargetShape
from common.runs.records import RunConfig
from workers.target_heads import input_embedding, output_head
from workers.train.drafter.config import DFlashConfig
from workers.train.drafter.model import DFlashDraftModel
from workers.train.drafter.shape import differences, shaped_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

TARGET_OWNED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")


def frozen_origin(config: RunConfig) -> DrafterOrigin:
    """The drafter shape run.json froze; a run without one (layout eagle3) trains none."""
    if config.drafter is None:
        raise DrafterShapeError(f"run {config.run}: layout {config.layout} trains no DFlash "
                                "drafter (its run.json freezes no drafter shape)")
    return config.drafter


def new_drafter(target: PreTrainedModel, mask_id: int, layer_ids: Sequence[int],
                origin: DrafterOrigin) -> DFlashDraftModel:
    """A run's first drafter, on the target's device, in its frozen shape (and, for a
    released drafter, its weights once their digest is the one frozen at enqueue)."""
    config = drafter_config(target, mask_id, layer_ids, origin)
    embed = input_embedding(target)
    drafter = DFlashDraftModel(config, embed, output_head(target))
    if origin.kind == OriginKind.INIT:
        load_released(drafter, verify_weights(origin))
    return drafter.to(embed.weight.device)


def drafter_config(target: PreTrainedModel, mask_id: int, layer_ids: Sequence[int],
                   origin: DrafterOrigin) -> DFlashConfig:
    """The target's drafter shape with the frozen origin's fields applied."""
    base = DFlashConfig.from_target(target.config, mask_id, layer_ids=layer_ids)
    config = shaped_config(base, origin.shape, TargetShape.of(target.config))
    if config.target_layer_ids != base.target_layer_ids:
        # The run's features (stored hidden states, the eval's) are of its frozen layers.
        raise DrafterShapeError(f"{describe_origin(origin)}: dflash_config.target_layer_ids "
                                f"{list(config.target_layer_ids)} != the run's target layers "
                                f"{list(base.target_layer_ids)} (frozen in run.json)")
    return config


def released_weights(path: Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter directory's safetensors files (one file or shards), named as
    the drafter names them: SGLang's ``model.`` prefix dropped, the target's own (embedding, LM
    head) and the rotary cache left out."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterShapeError(f"{what}: no .safetensors weights in it")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            found = load_file(str(file))
        except Exception as exc:   # a truncated or foreign file: one line naming it
            raise DrafterShapeError(f"{what}: {file.name} does not read as safetensors "
                                    f"({type(exc).__name__}: {str(exc)[:200]})") from None
        named = {k.removeprefix("model."): v for k, v in found.items()}
        twice = sorted(set(named) & set(weights))
        if twice:   # two files (a stale single file beside shards): which one serves is a guess
            raise DrafterShapeError(f"{what}: {twice[0]} is in {file.name} and in another "
                                    f"of its .safetensors files ({len(twice)} such tensors)")
        weights.update(named)
    return {k: v for k, v in weights.items()
            if not k.startswith(TARGET_OWNED) and not k.endswith("rotary_emb.inv_freq")}


def load_released(drafter: DFlashDraftModel, path: Path, what: str = "") -> None:
    """Load a released drafter's weights into ``drafter`` (built to its shape); every weight
    the drafter has must be in the files, and nothing else but the target's own."""
    what = what or f"--init-drafter {path}"
    weights = released_weights(path, what)
    own = drafter.state_dict()
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    if missing or extra:
        raise DrafterShapeError(f"{what}: weights do not fit its config.json "
                                f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for name, tensor in weights.items():
        if tensor.shape != own[name].shape:
            raise DrafterShapeError(f"{what}: {name} is {list(tensor.shape)}, "
                                    f"the config makes it {list(own[name].shape)}")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=True)
    log.info("drafter initialised from %s (%d tensors)", path, len(weights))


def check_same_shape(run: str, trained: DFlashConfig, target: PreTrainedModel, mask_id: int,
                     layer_ids: Sequence[int], origin: DrafterOrigin) -> None:
    """A run resumed from its checkpoint keeps the shape its run.json froze: a checkpoint of
    another shape (written by a release that shaped it otherwise) is refused in one line."""
    wanted = drafter_config(target, mask_id, layer_ids, origin)
    changed = differences(trained, wanted)
    if changed:
        raise DrafterShapeError(f"run {run}: its checkpoint's drafter has another shape than "
                                f"run.json's ({', '.join(changed)} differ); use a new run")


def origin_phrase(origin: DrafterOrigin) -> str:
    """`` from SOURCE`` for a log line: the shape's source."""
    return f" from {describe_origin(origin)}"


def describe(config: DFlashConfig) -> dict[str, Any]:
    """What a log line says of a drafter's shape."""
    return {"layers": config.num_hidden_layers, "layer_types": config.layer_types or "full",
            "window": config.sliding_window, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "block": config.block_size, "target_layers": list(config.target_layer_ids)}

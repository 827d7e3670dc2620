"""Where a run's new drafter comes from: the target alone, a published shape
(``--drafter-config``), or a released drafter's weights and shape (``--init-drafter``).

A run enqueued with either option has its shape frozen in run.json (:mod:`common.drafter_origin`):
every worker trains that shape, whatever its own options say (one log line when they differ).
The worker's options shape only the drafters of runs enqueued without one.

    drafter = new_drafter(target, mask_id, layers, settings.train, run=config)  # target's device
    check_train_options(settings)                                    # at worker start: exit 1

A released drafter is a directory as ``export-drafter`` writes and z-lab publishes:
``config.json`` and safetensors weights named as SGLang loads them (``layers.N.self_attn...``,
``fc.weight``, ``hidden_norm.weight``, ``norm.weight``); an embedding or LM head in the file is
the target's and is not loaded. Its target layers and mask token must be the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.config import Settings, TrainSettings
from common.drafter_origin import INIT, describe_origin, file_digest, frozen_shape, verify_weights
from common.records import RunConfig
from common.target import TargetShape
from workers.train.drafter.model import DFlashConfig, DFlashDraftModel
from workers.train.drafter.shape import (
    DrafterShapeError,
    check_target,
    differences,
    read_shape,
    shaped_config,
)

log = logging.getLogger(__name__)

TARGET_OWNED = ("embed_tokens.", "lm_head.", "model.embed_tokens.")


def shape_source(train: TrainSettings) -> str | None:
    """The file or directory that shapes a new drafter, if any."""
    return train.init_drafter or train.drafter_config or None


@dataclass(frozen=True)
class Origin:
    """A new drafter's shape fields, what names them, and the released weights to start from."""

    shape: dict[str, Any]
    where: str
    init_dir: Path | None = None


def worker_origin(train: TrainSettings) -> Origin | None:
    """The worker's own ``--drafter-config``/``--init-drafter`` (None: neither given)."""
    source = shape_source(train)
    if source is None:
        return None
    if train.init_drafter and train.drafter_config:
        raise DrafterShapeError("--init-drafter brings its own shape: leave out "
                                "--drafter-config")
    return Origin(read_shape(source), source,
                  Path(train.init_drafter) if train.init_drafter else None)


def run_origin(config: RunConfig | None, train: TrainSettings,
               weights: bool = True) -> Origin | None:
    """The shape frozen in the run's run.json, else the worker's options (runs enqueued without
    one). ``weights``: verify a released drafter's weights digest (before training from them)."""
    frozen = config.drafter if config is not None else None
    if not frozen:
        return worker_origin(train)
    assert config is not None
    own = shape_source(train)
    if own is not None and _digest_of(own) != frozen["sha256"]:
        log.info("run %s: trains the drafter shape frozen in its run.json, %s; this worker's "
                 "%s shapes only runs enqueued without one", config.run,
                 describe_origin(frozen), own)
    init = verify_weights(frozen) if weights and frozen.get("kind") == INIT else None
    return Origin(frozen_shape(frozen), str(describe_origin(frozen)), init)


def _digest_of(source: str) -> str | None:
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    try:
        return file_digest(path)
    except OSError:
        return None


def new_drafter(target: nn.Module, mask_id: int, layer_ids: Sequence[int],
                train: TrainSettings, run: RunConfig | None = None) -> DFlashDraftModel:
    """A run's first drafter, on the target's device (``run``: its frozen shape applies)."""
    origin = run_origin(run, train)
    config = drafter_config(target, mask_id, layer_ids, train, origin)
    embed = target.get_input_embeddings()
    drafter = DFlashDraftModel(config, embed, target.get_output_embeddings())
    if origin is not None and origin.init_dir is not None:
        load_released(drafter, origin.init_dir)
    return drafter.to(embed.weight.device)


def drafter_config(target: nn.Module, mask_id: int, layer_ids: Sequence[int],
                   train: TrainSettings, origin: Origin | None = None) -> DFlashConfig:
    """The target's drafter shape with a published or released config's fields applied
    (``origin``: the run's or the worker's, :func:`run_origin`)."""
    base = DFlashConfig.from_target(target.config, mask_id, layer_ids=layer_ids,
                                    num_hidden_layers=train.drafter_layers)
    if origin is None:
        return base
    source = origin.where
    config = shaped_config(base, origin.shape, TargetShape.of(target.config))
    if config.target_layer_ids != base.target_layer_ids:
        # The run's features (stored hidden states, the eval's) are of its frozen layers.
        wanted = ",".join(map(str, config.target_layer_ids))
        raise DrafterShapeError(f"{source}: dflash_config.target_layer_ids "
                                f"{list(config.target_layer_ids)} != the run's target layers "
                                f"{list(base.target_layer_ids)} (frozen in run.json: enqueue "
                                f"the run with --target-layers {wanted})")
    return config


def load_released(drafter: DFlashDraftModel, path: Path) -> None:
    """Load a released drafter's weights into ``drafter`` (built to its shape); every weight
    the drafter has must be in the files, and nothing else but the target's own."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterShapeError(f"--init-drafter {path}: no .safetensors weights in it")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    weights = {k: v for k, v in weights.items() if not k.startswith(TARGET_OWNED)}
    own = drafter.state_dict()
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    if missing or extra:
        raise DrafterShapeError(f"--init-drafter {path}: weights do not fit its config.json "
                                f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for name, tensor in weights.items():
        if tensor.shape != own[name].shape:
            raise DrafterShapeError(f"--init-drafter {path}: {name} is {list(tensor.shape)}, "
                                    f"the config makes it {list(own[name].shape)}")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=True)
    log.info("drafter initialised from %s (%d tensors)", path, len(weights))


def check_train_options(settings: Settings) -> None:
    """At worker start: the drafter config or released drafter is readable, a DFlash drafter,
    and fits the worker's target; raises :class:`DrafterShapeError` (one line, exit 1)."""
    train = settings.train
    source = shape_source(train)
    if source is None:
        return
    if train.init_drafter and train.drafter_config:
        raise DrafterShapeError("--init-drafter brings its own shape: leave out "
                                "--drafter-config")
    if train.init_drafter and not (Path(train.init_drafter) / "config.json").is_file():
        raise DrafterShapeError(f"--init-drafter {train.init_drafter}: not a drafter directory "
                                "(no config.json)")
    shape = read_shape(source)
    target = _target_shape(settings)
    if target is not None:   # its vocabulary is checked once loaded (the mask row may add one)
        check_target(shape, target, vocab=False)


def _target_shape(settings: Settings) -> TargetShape | None:
    """The worker's target shape from its config.json (no weights loaded), if it has one."""
    from common.errors import ConfigError
    from common.models import resolve_model_path

    try:
        return TargetShape.from_dir(resolve_model_path(settings))
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        log.warning("drafter config not checked against the target at start: %s", exc)
        return None


def check_same_shape(run: str, trained: DFlashConfig, target: nn.Module, mask_id: int,
                     layer_ids: Sequence[int], settings: Settings,
                     config: RunConfig | None = None) -> None:
    """A run resumed from its checkpoint keeps its drafter's shape: a drafter config that would
    change it is refused (the shape is frozen by the run's first checkpoint)."""
    origin = run_origin(config, settings.train, weights=False)
    if origin is None:
        return
    wanted = drafter_config(target, mask_id, layer_ids, settings.train, origin)
    changed = differences(trained, wanted)
    if changed:
        raise DrafterShapeError(f"run {run}: its drafter was trained with another shape "
                                f"({', '.join(changed)} differ from the drafter config); "
                                "use a new run, or leave the option out")


def origin_phrase(config: RunConfig, train: TrainSettings) -> str:
    """`` from SOURCE`` for a log line: the shape's source, if anything but the target."""
    source = describe_origin(config.drafter) if config.drafter else shape_source(train)
    return f" from {source}" if source else ""


def describe(config: DFlashConfig) -> dict[str, Any]:
    """What a log line says of a drafter's shape."""
    return {"layers": config.num_hidden_layers, "layer_types": config.layer_types or "full",
            "window": config.sliding_window, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "block": config.block_size, "target_layers": list(config.target_layer_ids)}

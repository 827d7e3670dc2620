"""The run's drafter as enqueue freezes it: the options' drafter config, released drafter or
default shape, checked against the target, with the run's target layer ids."""

from __future__ import annotations

from common.choices import Layout
from common.drafter.origin import DrafterOrigin, default_origin, freeze_origin
from common.drafter.shape import DrafterShapeError
from common.engine.target import TargetShape
from common.runs.options import RunOptions


def enqueue_origin(options: RunOptions,
                   target: TargetShape) -> tuple[DrafterOrigin | None, list[int] | None]:
    """``(run.json's drafter, the run's target layer ids)`` for enqueue's options: the drafter
    config's ``target_layer_ids`` are the run's unless ``--target-layers`` names them too, and
    then the two must agree; without a config, the target's shape. Any refusal is
    :class:`OptionRefused` (one line, exit 2)."""
    from common.drafter.layers import resolve_target_layers
    from common.errors import OptionRefused

    try:
        origin = freeze_origin(options.drafter_config, options.init_drafter, target)
        stated = origin.layer_ids if origin else None
    except DrafterShapeError as exc:
        raise OptionRefused(str(exc)) from None
    if options.layout is not Layout.DFLASH:
        if origin:
            raise OptionRefused("--drafter-config/--init-drafter shape a DFlash drafter: "
                                f"use --layout dflash, not {options.layout}")
        return None, None   # eagle3 keeps its fixed layers and trains no DFlash drafter
    if stated is not None and options.target_layers is None:
        return origin, stated
    layer_ids = resolve_target_layers(options.target_layers, target)
    if origin is None:
        return default_origin(options.drafter_layers, layer_ids), layer_ids
    if stated is not None and stated != layer_ids:
        raise OptionRefused(f"--target-layers {options.target_layers} gives layers "
                            f"{layer_ids}, but {origin.name} states "
                            f"dflash_config.target_layer_ids {stated}: leave --target-layers "
                            "out or make them agree")
    return origin, layer_ids

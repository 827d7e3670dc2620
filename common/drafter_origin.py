"""Where a run's drafter comes from, frozen in run.json: a published shape or a released drafter.

``enqueue --drafter-config FILE`` freezes the file's name, digest and content (the shape, so a
worker never needs the file); ``enqueue --init-drafter DIR`` freezes the released drafter's
``config.json`` the same way plus its directory and a digest of its safetensors weights, which
the train worker verifies before it starts from them. Both are checked against the target here,
before anything is queued::

    origin = freeze_origin(drafter_config=None, init_drafter="/ckpt/released", target=shape)
    run_config = RunConfig(..., drafter=origin)            # run.json's ``drafter``
    describe_origin(run_config.drafter)                    # "config.json (sha256 1a2b3c4d5e6f)"
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from common.drafter_shape import DrafterShapeError, check_target, checked_shape, read_shape
from common.target import TargetShape

CONFIG, INIT = "config", "init"   # the two kinds: --drafter-config, --init-drafter


def file_digest(path: Path) -> str:
    """sha256 of one file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_digest(directory: Path) -> str:
    """sha256 over a released drafter's ``*.safetensors`` files: each name and its digest."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise DrafterShapeError(f"--init-drafter {directory}: no .safetensors weights in it")
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name} {file_digest(file)}\n".encode())
    return digest.hexdigest()


def freeze_origin(drafter_config: str | None, init_drafter: str | None,
                  target: TargetShape) -> dict[str, Any] | None:
    """run.json's ``drafter`` for the enqueue options (None: the target alone shapes it);
    raises :class:`DrafterShapeError` naming the field the target or the files contradict."""
    if drafter_config and init_drafter:
        raise DrafterShapeError("--init-drafter brings its own shape: leave out "
                                "--drafter-config")
    if not (drafter_config or init_drafter):
        return None
    if init_drafter:
        directory = Path(init_drafter).resolve()
        file = directory / "config.json"
        if not file.is_file():
            raise DrafterShapeError(f"--init-drafter {init_drafter}: not a drafter directory "
                                    "(no config.json)")
    else:
        file = Path(str(drafter_config)).resolve()
    shape = read_shape(file)
    check_target(shape, target, vocab=False)   # its vocabulary: once the mask token is added
    origin: dict[str, Any] = {
        "kind": INIT if init_drafter else CONFIG, "name": file.name, "path": str(file),
        "sha256": file_digest(file), "config": json.loads(file.read_text())}
    if init_drafter:
        origin.update(name=directory.name, path=str(directory),
                      weights_sha256=weights_digest(directory))
    return origin


def frozen_shape(origin: dict[str, Any]) -> dict[str, Any]:
    """The checked shape fields of a frozen origin (as :func:`read_shape` gives a file's)."""
    return checked_shape(origin["config"], f"{origin['name']} (frozen in run.json)")


def layer_ids_of(origin: dict[str, Any] | None) -> list[int] | None:
    """The target layers a frozen origin states (``dflash_config.target_layer_ids``), if any."""
    if not origin:
        return None
    ids = frozen_shape(origin).get("dflash.target_layer_ids")
    return list(ids) if ids is not None else None


def verify_weights(origin: dict[str, Any]) -> Path:
    """The released drafter's directory once its weights are the ones frozen at enqueue."""
    directory = Path(origin["path"])
    if not directory.is_dir():
        raise DrafterShapeError(f"--init-drafter {directory} (frozen in run.json): not found on "
                                "this host; mount it at the same path")
    found = weights_digest(directory)
    if found != origin["weights_sha256"]:
        raise DrafterShapeError(f"--init-drafter {directory}: its weights changed since enqueue "
                                f"(sha256 {found[:12]} != run.json's "
                                f"{origin['weights_sha256'][:12]}); restore them or use a "
                                "new run")
    return directory


def describe_origin(origin: dict[str, Any] | None) -> str | None:
    """One phrase naming the shape's source: ``file (sha256 1a2b3c4d5e6f)``; None: the target."""
    if not origin:
        return None
    what = "--init-drafter" if origin.get("kind") == INIT else "--drafter-config"
    return f"{origin['name']} (sha256 {origin['sha256'][:12]}, {what})"


def origin_json(origin: dict[str, Any] | None) -> dict[str, Any] | None:
    """What ``--json`` outputs show of the origin: its source without the config's content."""
    if not origin:
        return None
    return {k: origin[k] for k in ("kind", "name", "path", "sha256", "weights_sha256")
            if k in origin}


def drafter_summary(origin: dict[str, Any] | None,
                    layer_ids: list[int] | None) -> dict[str, Any] | None:
    """What ``status``, enqueue's report and the dashboard show of a run's frozen drafter shape:
    its source in one phrase, name, path, digests and the run's target layers (None: none)."""
    if not origin:
        return None
    return {"source": describe_origin(origin), **(origin_json(origin) or {}),
            "target_layer_ids": layer_ids}


def enqueue_origin(drafter_config: str | None, init_drafter: str | None, layout: str,
                   target_layers: str | int | None,
                   target: TargetShape) -> tuple[dict[str, Any] | None, list[int] | None]:
    """``(run.json's drafter, the run's target layer ids)`` for enqueue's options: the drafter
    config's ``target_layer_ids`` are the run's unless ``--target-layers`` names them too, and
    then the two must agree. Any refusal is :class:`OptionRefused` (one line, exit 2)."""
    from common.errors import OptionRefused
    from common.layers import resolve_target_layers

    try:
        origin = freeze_origin(drafter_config, init_drafter, target)
        stated = layer_ids_of(origin)
    except DrafterShapeError as exc:
        raise OptionRefused(str(exc)) from None
    if layout != "dflash":
        if origin:
            raise OptionRefused("--drafter-config/--init-drafter shape a DFlash drafter: "
                                f"use --layout dflash, not {layout}")
        return None, None   # eagle3 keeps its fixed layers
    if stated is not None and target_layers is None:
        return origin, stated
    layer_ids = resolve_target_layers(target_layers, target)
    if stated is not None and stated != layer_ids:
        raise OptionRefused(f"--target-layers {target_layers} gives layers {layer_ids}, but "
                            f"{origin['name']} states dflash_config.target_layer_ids "
                            f"{stated}: leave --target-layers out or make them agree")
    return origin, layer_ids

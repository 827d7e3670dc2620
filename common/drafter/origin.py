"""Where a run's drafter comes from, frozen in run.json: the target's own shape (the default),
a published shape, or a released drafter.

Every DFlash run freezes one :class:`DrafterOrigin` at enqueue, so a worker never decides a
shape. ``enqueue`` alone gives the target's shape with ``--drafter-layers`` decoder layers;
``--drafter-config FILE`` freezes the file's name, digest and content (the shape, so a worker
never needs the file); ``--init-drafter DIR`` freezes the released drafter's ``config.json`` the
same way plus its directory and a digest of its safetensors weights, which the train worker
verifies before it starts from them. Each is checked against the target before anything is
queued::

    origin, layer_ids = enqueue_origin(options, target=shape)   # producer/enqueue_drafter.py
    run_config = RunConfig(..., drafter=origin)            # run.json's ``drafter``
    describe_origin(run_config.drafter)      # "config.json (sha256 1a2b3c4d5e6f, ...)"
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NotRequired

from typing_extensions import TypedDict  # pydantic reads it on Python 3.11

from common.choices import OriginKind
from common.drafter.shape import (
    ARCHITECTURE,
    DrafterShapeError,
    check_target,
    checked_shape,
    read_shape,
)
from common.engine.target import TargetShape


@dataclass(frozen=True)
class DrafterOrigin:
    """run.json's ``drafter``: the shape's source, its config.json content and digests."""

    kind: OriginKind
    name: str                    # the file's (or released directory's) name; "target" for DEFAULT
    sha256: str                  # of the config file (DEFAULT: of the canonical JSON below)
    config: dict[str, Any]       # the drafter config.json fields that shape it
    path: str | None = None      # where the file or released directory was read (a record only)
    weights_sha256: str | None = None   # INIT: the released safetensors' digest

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DrafterOrigin:
        return cls(kind=OriginKind(data["kind"]), name=data["name"], sha256=data["sha256"],
                   config=dict(data["config"]), path=data.get("path"),
                   weights_sha256=data.get("weights_sha256"))

    @property
    def shape(self) -> dict[str, Any]:
        """The checked shape fields (as :func:`read_shape` gives a file's)."""
        return checked_shape(self.config, f"{self.name} (frozen in run.json)")

    @property
    def layer_ids(self) -> list[int] | None:
        """The target layers it states (``dflash_config.target_layer_ids``), if any."""
        ids = self.shape.get("dflash.target_layer_ids")
        return list(ids) if ids is not None else None


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


def default_origin(layers: int, layer_ids: list[int]) -> DrafterOrigin:
    """The target's own shape, ``layers`` decoder layers over the run's target layers."""
    config = {"architectures": [ARCHITECTURE], "num_hidden_layers": layers,
              "dflash_config": {"target_layer_ids": list(layer_ids)}}
    text = json.dumps(config, sort_keys=True).encode()
    return DrafterOrigin(OriginKind.DEFAULT, "target", hashlib.sha256(text).hexdigest(), config)


def freeze_origin(drafter_config: str | None, init_drafter: str | None,
                  target: TargetShape) -> DrafterOrigin | None:
    """run.json's ``drafter`` for ``--drafter-config``/``--init-drafter`` (None: neither given);
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
    config = json.loads(file.read_text())
    if init_drafter:
        return DrafterOrigin(OriginKind.INIT, directory.name, file_digest(file), config,
                             str(directory), weights_digest(directory))
    return DrafterOrigin(OriginKind.CONFIG, file.name, file_digest(file), config, str(file))


def verify_weights(origin: DrafterOrigin) -> Path:
    """The released drafter's directory once its weights are the ones frozen at enqueue."""
    directory = Path(str(origin.path))
    if not directory.is_dir():
        raise DrafterShapeError(f"--init-drafter {directory} (frozen in run.json): not found on "
                                "this host; mount it at the same path")
    found = weights_digest(directory)
    if found != origin.weights_sha256:
        raise DrafterShapeError(f"--init-drafter {directory}: its weights changed since enqueue "
                                f"(sha256 {found[:12]} != run.json's "
                                f"{str(origin.weights_sha256)[:12]}); restore them or use a "
                                "new run")
    return directory


def describe_origin(origin: DrafterOrigin | None) -> str | None:
    """One phrase naming the shape's source: ``file (sha256 1a2b3c4d5e6f, --drafter-config)``,
    or the target's with its depth; None for a run without a DFlash drafter (eagle3)."""
    return None if origin is None else _source_phrase(origin)


def _source_phrase(origin: DrafterOrigin) -> str:
    """:func:`describe_origin` of an origin there is."""
    if origin.kind == OriginKind.DEFAULT:
        return (f"the target's shape, {origin.config['num_hidden_layers']} layers "
                "(--drafter-layers)")
    what = "--init-drafter" if origin.kind == OriginKind.INIT else "--drafter-config"
    return f"{origin.name} (sha256 {origin.sha256[:12]}, {what})"


def origin_json(origin: DrafterOrigin | None) -> dict[str, Any] | None:
    """What ``--json`` outputs show of the origin: its source without the config's content."""
    if origin is None:
        return None
    return {k: v for k, v in origin.to_json().items() if k != "config"}


class DrafterSummary(TypedDict):
    """:func:`drafter_summary`'s record (``status --json``'s ``drafter``)."""

    source: str
    kind: OriginKind
    name: str
    sha256: str
    path: NotRequired[str]
    weights_sha256: NotRequired[str]
    target_layer_ids: list[int] | None


def drafter_summary(origin: DrafterOrigin | None,
                    layer_ids: list[int] | None) -> DrafterSummary | None:
    """What ``status``, enqueue's report and the dashboard show of a run's frozen drafter shape:
    its source in one phrase, name, path, digests and the run's target layers (None: none);
    :func:`origin_json`'s fields, the config's content left out."""
    if origin is None:
        return None
    summary: DrafterSummary = {"source": _source_phrase(origin), "kind": origin.kind,
                               "name": origin.name, "sha256": origin.sha256,
                               "target_layer_ids": layer_ids}
    if origin.path is not None:
        summary["path"] = origin.path
    if origin.weights_sha256 is not None:
        summary["weights_sha256"] = origin.weights_sha256
    return summary

"""An exported drafter's file names, and the check that a directory holds them (no torch: the
CLI refuses a wrong directory before it loads a target)."""

from __future__ import annotations

from pathlib import Path

from common.errors import DrafterMismatch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def check_export_dir(path: str | Path) -> Path:
    """``path`` as a Path when it holds a drafter's config and safetensors weights (ours, or a
    published layout's: ``model.safetensors`` or its shards); DrafterMismatch if not."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not any(path.glob("*.safetensors")):
        raise DrafterMismatch(f"{path} is not a drafter export (needs {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE} or its .safetensors shards: export-drafter's, "
                              "z-lab's or SpecForge's layout)")
    return path

"""The target model directory doctor and serve-command check (one place, so neither imports
the other)."""

from __future__ import annotations

from pathlib import Path

from common.config import Settings


def target_dir(settings: Settings) -> tuple[Path, bool]:
    """The target model's directory and whether it is there (the tiny model may be unbuilt)."""
    if settings.model_is_tiny:
        from embedded.tinyconsts import READY_MARKER, tiny_model_dir

        path = tiny_model_dir(settings.target.cache_dir, settings.target.model)
        return path, (path / READY_MARKER).is_file()
    path = Path(settings.target.model).expanduser()
    return path, path.is_dir()

"""Settings: one frozen dataclass section each (:mod:`common.config_sections`), loaded from the
``DFLASH_*`` variables; the only module that reads them.

Each field is declared once, in its section: its flat name is the section's prefix + the field's
name (``hidden.device``: ``hidden_device``), its variable ``DFLASH_`` + the flat name in capitals
(``DFLASH_HIDDEN_DEVICE``). CLI options for settings take their default and variable from there
(:func:`common.cli.options_for`); code reads a setting by section: ``settings.hidden.device``.
Keywords by flat name are typed from the declarations by scripts/mypy_settings.py (a mypy plugin):
a misspelt one, or a value of the wrong type, fails the checker.

Every process (producer CLI, workers, Flower) calls :func:`load_settings` once and passes the
result down, so the broker URL, storage root and queue timeouts always agree across services.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.choices import TinyModel
from common.config_fields import (
    DEVICE,
    DEVICES,
    ENV_PREFIX,
    as_field,
    coerce,
    default_cache_dir,
    env_name,
    mask_flags,
    mask_url,
    section_fields,
    setting,
)
from common.config_sections import (
    FIELDS,
    SECTIONS,
    TINY_MODEL,
    BrokerSettings,
    GenerateSettings,
    HiddenSettings,
    ReadSettings,
    TargetSettings,
    TrainSettings,
    UiSettings,
    WorkerSettings,
)

__all__ = [
    "DEVICE", "DEVICES", "ENV_PREFIX", "FIELDS", "SECTIONS", "TINY_MODEL", "BrokerSettings",
    "GenerateSettings", "HiddenSettings", "ReadSettings", "Settings", "TargetSettings",
    "TrainSettings", "UiSettings", "WorkerSettings",
    "default_cache_dir", "env_name", "load_settings", "mask_url", "section_fields", "setting",
]


@dataclass(frozen=True, init=False, repr=False)
class Settings:
    """Process-wide settings in sections, read by section (``settings.train.rows_per_step``);
    derived values are properties so they cannot drift. Flat names (``train_rows_per_step``)
    exist only to derive variable and option names, and as keywords here."""

    broker: BrokerSettings
    worker: WorkerSettings
    target: TargetSettings
    generate: GenerateSettings
    hidden: HiddenSettings
    train: TrainSettings
    read: ReadSettings
    ui: UiSettings

    def __init__(self, **typed: object) -> None:
        """Sections by name and fields by flat name (``model=``: what ``replace`` passes too);
        a flat value wins over its section's."""
        values: dict[str, Any] = dict(typed)
        for name, cls in SECTIONS.items():
            section = values.pop(name, None) or cls()
            flat = {f.name: as_field(values.pop(key), f) for key, f in section_fields(cls)
                    if key in values}
            object.__setattr__(self, name, replace(section, **flat) if flat else section)
        if values:
            raise TypeError(f"unknown settings: {', '.join(sorted(values))}")

    def replace(self, **flat: object) -> Settings:
        """These settings with fields given by flat name (``model=``, ``train_nnodes=``)."""
        values: dict[str, Any] = {name: getattr(self, name) for name in SECTIONS}
        return Settings(**{**values, **flat})

    def __repr__(self) -> str:
        shown = ", ".join(f"{flat}={self._shown(flat)!r}" for flat in FIELDS)
        return f"Settings({shown})"

    def _shown(self, name: str) -> str:
        section, f = FIELDS[name]
        value = str(getattr(getattr(self, section), f.name))
        return "***" if f.metadata.get("secret") and value else mask_flags(mask_url(value))

    @property
    def masked_broker_url(self) -> str:
        return mask_url(self.broker.url)

    @property
    def storage_is_s3(self) -> bool:
        return self.broker.storage.startswith("s3://")

    @property
    def engine_server_port(self) -> int:
        """One port per GPU so several workers on a host never collide."""
        return self.generate.engine_port + self.worker.gpu

    @property
    def engines_dir(self) -> Path:
        """Engine servers' pid files and logs."""
        return (Path(self.target.engine_dir).expanduser() if self.target.engine_dir
                else self.target.cache_dir / "engines")

    @property
    def model_is_tiny(self) -> bool:
        """The model is one of the embedded CPU targets (built on first use)."""
        return TinyModel.named(self.target.model) is not None


def load_settings(env: Mapping[str, str] | None = None,
                  **overrides: object) -> Settings:
    """Read settings from ``DFLASH_*`` variables; explicit overrides (CLI options) win."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, (_, f) in FIELDS.items():
        raw = env.get(env_name(name))
        if raw not in (None, ""):
            values[name] = coerce(name, raw, f)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)

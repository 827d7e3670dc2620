"""Per-command options declared once, in sections like the settings: each field's default here,
its ``DFLASH_*`` variable derived from its flat name (:func:`common.cli.command_option`).

These are read by click for the one command that takes them (a run id, an input, a report
flag), never by :func:`common.config.load_settings`; the defaults of the values frozen into
run.json come from the records they fill (sampling, gates, held-out split), never restated.
"""

from __future__ import annotations

from dataclasses import Field, dataclass
from typing import Any, ClassVar

from common.config import section_fields
from common.epochs import RECIPE_EPOCHS
from common.gates import GateConfig
from common.splits import HELDOUT_FRACTION, HELDOUT_MIN


@dataclass(frozen=True)
class CliOptions:
    """What every command takes."""

    verbose: bool = False


@dataclass(frozen=True)
class RunOptions:
    """A run and what enqueue freezes into its run.json: input, sampling, layout, gates."""

    run: str | None = None
    input: tuple[str, ...] | None = None
    format: str = "auto"
    prompt_field: str | None = None
    prompt_template: str | None = None
    strict_fields: bool = False
    shard_size: int = 256
    limit: int | None = None
    # None: what the target allows (its context, at most MAX_NEW_TOKENS_CAP).
    max_new_tokens: int | None = None
    # None: the target's generation_config.json, else the Sampling record's default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    thinking: str = "on"   # on, off or mix:R (common.thinking)
    chat_template_kwargs: str | None = None   # a JSON object, parsed at enqueue
    mode: str = "offline"
    layout: str = "dflash"
    target_layers: str | None = None
    drafter_config: str | None = None   # a published DFlash config.json: the drafter's shape
    init_drafter: str | None = None     # a released drafter directory: its shape and weights
    heldout_fraction: float = HELDOUT_FRACTION
    heldout_min: int = HELDOUT_MIN
    epochs: int = RECIPE_EPOCHS
    patience: int | None = None
    min_supervised_tokens: int = GateConfig.min_supervised_tokens
    max_reject_rate: float = GateConfig.max_reject_rate
    pause_after: int = GateConfig.pause_after
    min_answer_tokens: int = GateConfig.min_answer_tokens


@dataclass(frozen=True)
class ReportOptions:
    """``report``: how it prints and where its figure goes."""

    PREFIX: ClassVar[str] = "report_"
    json: bool = False
    png: str | None = None
    no_png: bool = False


@dataclass(frozen=True)
class UiOptions:
    """``ui``: where the dashboard listens (its auth is the ``ui_auth`` setting)."""

    PREFIX: ClassVar[str] = "ui_"
    host: str = "127.0.0.1"
    port: int = 8700


@dataclass(frozen=True)
class WorkerOptions:
    """``worker generate|hidden|train``: the Celery process itself."""

    loglevel: str = "INFO"
    worker_name: str | None = None
    concurrency: int | None = None   # unset: 2 shards with SGLang, 1 with the CPU engine


SECTIONS: tuple[type, ...] = (CliOptions, RunOptions, ReportOptions, UiOptions, WorkerOptions)
OPTIONS: dict[str, Field[Any]] = {
    flat: f for section in SECTIONS for flat, f in section_fields(section)
}
"""Every per-command option by flat name (its variable is ``env_name(flat)``)."""

"""Every keyword :class:`common.config.Settings` takes, with its type, so a checker refuses a
misspelt one (PEP 692: ``**values: Unpack[SettingValues]``).

One key per section and per flat setting name (tests/test_settings_keywords.py keeps them equal
to the sections' fields); :class:`SettingOverrides` is the same with ``None`` for "not given", as
a CLI option left unset passes to :func:`common.config.load_settings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from common.choices import Checkpointing, EngineKind, MtpMode, Parallel
from common.config_sections import (
    BrokerSettings,
    GenerateSettings,
    HiddenSettings,
    ReadSettings,
    TargetSettings,
    TrainSettings,
    UiSettings,
    WorkerSettings,
)


class SettingValues(TypedDict, total=False):
    """A section by name, or one setting by its flat name (a flat value wins over its section's)."""

    broker: BrokerSettings
    worker: WorkerSettings
    target: TargetSettings
    generate: GenerateSettings
    hidden: HiddenSettings
    train: TrainSettings
    read: ReadSettings
    ui: UiSettings
    broker_url: str
    storage: str
    visibility_timeout: int
    result_expires: int
    soft_shutdown_timeout: float
    lease_ttl: float
    max_deliveries: int
    retry_backoff_max: float
    gpu: int
    metrics_port: int
    metrics_host: str
    model: str
    cache_dir: Path
    engine_dir: str
    part_samples: int
    part_seconds: float
    batch_size: int
    engine: EngineKind
    engine_url: str
    engine_cmd: str
    engine_args: str
    mtp: MtpMode
    mtp_switch_dwell: float
    mtp_measure_window: float
    mtp_margin: float
    engine_python: str
    engine_port: int
    tp: int
    mem_fraction_static: str
    max_in_flight: int
    engine_startup_timeout: float
    engine_drain_timeout: float
    request_timeout: float
    hidden_batch_tokens: int
    hidden_device: str
    hidden_part_bytes: int
    train_checkpoint_steps: int
    train_rows_per_step: int
    train_total_steps: int
    train_min_supervised_tokens: int
    train_max_anchors: int
    train_batch_tokens: int
    train_activation_checkpointing: Checkpointing
    train_memory_margin: float
    train_eval_steps: int
    train_eval_prompts: int
    train_eval_max_new_tokens: int
    train_device: str
    train_nproc_per_node: int
    train_nnodes: int
    train_node_rank: int
    train_rdzv_endpoint: str
    train_parallel: Parallel
    tensorboard_dir: str
    read_json_bytes: int
    read_index_bytes: int
    read_index_decoded_bytes: int
    read_part_bytes: int
    read_part_decoded_bytes: int
    read_part_rows: int
    read_row_bytes: int
    ui_auth: str
    ui_engine_networks: str


class SettingOverrides(TypedDict, total=False):
    """A setting by its flat name, or None where an option was not given (the variable or the
    default stays)."""

    broker_url: str | None
    storage: str | None
    visibility_timeout: int | None
    result_expires: int | None
    soft_shutdown_timeout: float | None
    lease_ttl: float | None
    max_deliveries: int | None
    retry_backoff_max: float | None
    gpu: int | None
    metrics_port: int | None
    metrics_host: str | None
    model: str | None
    cache_dir: Path | None
    engine_dir: str | None
    part_samples: int | None
    part_seconds: float | None
    batch_size: int | None
    engine: EngineKind | None
    engine_url: str | None
    engine_cmd: str | None
    engine_args: str | None
    mtp: MtpMode | None
    mtp_switch_dwell: float | None
    mtp_measure_window: float | None
    mtp_margin: float | None
    engine_python: str | None
    engine_port: int | None
    tp: int | None
    mem_fraction_static: str | None
    max_in_flight: int | None
    engine_startup_timeout: float | None
    engine_drain_timeout: float | None
    request_timeout: float | None
    hidden_batch_tokens: int | None
    hidden_device: str | None
    hidden_part_bytes: int | None
    train_checkpoint_steps: int | None
    train_rows_per_step: int | None
    train_total_steps: int | None
    train_min_supervised_tokens: int | None
    train_max_anchors: int | None
    train_batch_tokens: int | None
    train_activation_checkpointing: Checkpointing | None
    train_memory_margin: float | None
    train_eval_steps: int | None
    train_eval_prompts: int | None
    train_eval_max_new_tokens: int | None
    train_device: str | None
    train_nproc_per_node: int | None
    train_nnodes: int | None
    train_node_rank: int | None
    train_rdzv_endpoint: str | None
    train_parallel: Parallel | None
    tensorboard_dir: str | None
    read_json_bytes: int | None
    read_index_bytes: int | None
    read_index_decoded_bytes: int | None
    read_part_bytes: int | None
    read_part_decoded_bytes: int | None
    read_part_rows: int | None
    read_row_bytes: int | None
    ui_auth: str | None
    ui_engine_networks: str | None

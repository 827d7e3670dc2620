"""Settings as frozen dataclasses; the only module that reads ``DFLASH_*`` environment variables.

Each field's variable is derived from its name (field ``lease_ttl``: prefix + ``LEASE_TTL``); CLI
options for settings take their default and variable from here (:func:`common.cli.setting_option`).

Every process (producer CLI, workers, Flower) calls :func:`load_settings` once and passes the
result down, so the broker URL, storage root and queue timeouts always agree across services.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from common.errors import ConfigError
from embedded.tinyconsts import TINY_MODELS, TINY_QWEN3

TINY_MODEL = TINY_QWEN3
"""The embedded default model: built locally on first use, runs on CPU. ``TINY_MODELS`` names
every embedded target: tiny-qwen3 (dense) and tiny-qwen3.5 (a hybrid in Qwen3.6's shape)."""

_SECRETS = {"ui_auth"}
_SECRET_IN_URL = re.compile(r"(://[^:/@]*:)([^@]*)(@)")


def mask_url(url: str) -> str:
    """Hide the password of a URL such as ``redis://:secret@host:6379/0`` for logs and repr."""
    return _SECRET_IN_URL.sub(r"\1***\3", url)


def default_cache_dir() -> Path:
    """Where built artefacts (the tiny CPU model) live unless the cache_dir setting says so."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-pipeline"


@dataclass(frozen=True)
class Settings:
    """Process-wide settings; derived values are properties so they cannot drift."""

    broker_url: str = "redis://127.0.0.1:6379/0"
    storage: str = ".dflash/storage"
    model: str = TINY_MODEL
    cache_dir: Path = default_cache_dir()
    # Celery re-delivers an unacked message after this many seconds: keep it above the longest
    # shard, and identical in producer, workers and Flower (the shortest one wins).
    visibility_timeout: int = 6 * 3600
    result_expires: int = 24 * 3600
    soft_shutdown_timeout: float = 60.0
    lease_ttl: float = 60.0
    max_deliveries: int = 5
    part_samples: int = 64
    part_seconds: float = 60.0
    batch_size: int = 16
    engine: str = "cpu"
    # SGLang engine: an external server (engine_url) or one the worker starts (engine_cmd, or
    # `python -m sglang.launch_server` built from model/tp/mem_fraction_static/engine_args).
    engine_url: str = ""
    engine_cmd: str = ""
    engine_args: str = ""
    engine_port: int = 30000
    gpu: int = 0
    tp: int = 1
    mem_fraction_static: str = ""
    max_in_flight: int = 128
    engine_startup_timeout: float = 900.0
    request_timeout: float = 3600.0
    metrics_port: int = 0
    retry_backoff_max: float = 60.0
    hidden_batch_tokens: int = 32768
    hidden_device: str = "auto"
    hidden_part_bytes: int = 512 * 2**20
    train_checkpoint_steps: int = 50
    train_rows_per_step: int = 8
    train_total_steps: int = 2000
    train_min_supervised_tokens: int = 0   # 0: two blocks' worth (2 x block size)
    train_eval_steps: int = 200            # speculative-decoding eval every N steps (0: off)
    train_eval_prompts: int = 8
    train_eval_max_new_tokens: int = 256
    drafter_layers: int = 5
    # Data-parallel training (torch.distributed): ranks per host, hosts, this host's rank, and
    # the rank-0 host's HOST:PORT that the hosts meet at (unset on one host).
    train_nproc_per_node: int = 1
    train_nnodes: int = 1
    train_node_rank: int = 0
    train_rdzv_endpoint: str = ""
    train_parallel: str = "ddp"   # ddp: a drafter replica per rank; fsdp: FSDP2 shards
    tensorboard_dir: str = ""  # train workers also write per-step metrics there when set
    ui_auth: str = ""  # user:password of the dashboard's basic auth (like Flower's)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={self._shown(f.name)!r}" for f in fields(self))
        return f"Settings({shown})"

    def _shown(self, name: str) -> str:
        value = str(getattr(self, name))
        return "***" if name in _SECRETS and value else mask_url(value)

    @property
    def masked_broker_url(self) -> str:
        return mask_url(self.broker_url)

    @property
    def storage_is_s3(self) -> bool:
        return self.storage.startswith("s3://")

    @property
    def engine_server_port(self) -> int:
        """One port per GPU so several workers on a host never collide."""
        return self.engine_port + self.gpu

    @property
    def model_is_tiny(self) -> bool:
        """The model is one of the embedded CPU targets (built on first use)."""
        return self.model in TINY_MODELS


ENV_PREFIX = "DFLASH_"


def env_name(name: str) -> str:
    """The environment variable of a settings field: ``DFLASH_`` + its name in capitals."""
    return ENV_PREFIX + name.upper()


# 0 means "off" or "the default" for these, or is a valid index.
_ZERO_OK = {"gpu", "metrics_port", "train_node_rank", "train_eval_steps",
            "train_min_supervised_tokens"}


def _coerce(name: str, raw: str, like: object) -> object:
    kind = type(like)
    try:
        value = kind(raw) if kind is not Path else Path(raw).expanduser()
    except ValueError as exc:
        raise ConfigError(f"{env_name(name)}={raw!r} is not a valid {kind.__name__}") from exc
    if isinstance(value, int | float) and (value < 0 or (value == 0 and name not in _ZERO_OK)):
        raise ConfigError(f"{env_name(name)}={raw!r} must be positive")
    return value


def load_settings(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Read settings from ``DFLASH_*`` variables; explicit overrides (CLI options) win."""
    env = os.environ if env is None else env
    base = Settings()
    values: dict[str, object] = {}
    for name in (f.name for f in fields(Settings)):
        raw = env.get(env_name(name))
        if raw not in (None, ""):
            values[name] = _coerce(name, raw, getattr(base, name))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return replace(base, **values)

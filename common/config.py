"""Settings as frozen dataclass sections; the only module that reads ``DFLASH_*`` variables.

Each field is declared once, in its section: its flat name is the section's prefix + the field's
name (``hidden.device``: ``hidden_device``), its variable ``DFLASH_`` + the flat name in capitals
(``DFLASH_HIDDEN_DEVICE``). CLI options for settings take their default and variable from here
(:func:`common.cli.setting_option`); code reads a setting by section: ``settings.hidden.device``.

Every process (producer CLI, workers, Flower) calls :func:`load_settings` once and passes the
result down, so the broker URL, storage root and queue timeouts always agree across services.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import Field, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from common.choices import Checkpointing, EngineKind, MtpMode
from common.errors import ConfigError
from embedded.tinyconsts import TINY_MODELS, TINY_QWEN3

TINY_MODEL = TINY_QWEN3
"""The embedded default model: built locally on first use, runs on CPU. ``TINY_MODELS`` names
every embedded target: tiny-qwen3 (dense) and tiny-qwen3.5 (a hybrid in Qwen3.6's shape)."""

ENV_PREFIX = "DFLASH_"
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
DEVICES = "auto, cpu, cuda, cuda:N or mps"
"""What a device setting accepts (checked at load, so a typo names its variable)."""
# A URL's userinfo runs to the last "@" before the host: a password may hold a raw "@" (or ":").
_USERINFO = re.compile(r"(?<=://)([^\s'\"<>@]*@)+")


def mask_url(url: str) -> str:
    """Hide the whole password of each URL in ``url`` (``redis://:secret@host:6379/0``; a raw
    ``@`` in it too) for logs and repr: the user name stays, a userinfo without one is hidden."""
    def hide(match: re.Match[str]) -> str:
        user, colon, _ = match.group(0)[:-1].partition(":")
        return f"{user}:***@" if colon else "***@"

    return _USERINFO.sub(hide, url)


def default_cache_dir() -> Path:
    """Where built artefacts (the tiny CPU model) live unless the cache_dir setting says so."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-pipeline"


def env_name(name: str) -> str:
    """The environment variable of a field's flat name: ``DFLASH_`` + the name in capitals."""
    return ENV_PREFIX + name.upper()


def setting(default: Any, *, flat: str = "", zero_ok: bool = False, secret: bool = False,
            device: bool = False, below: float | None = None) -> Any:
    """A declared field: ``flat`` replaces prefix + name (a variable older than its section),
    ``zero_ok`` lets a number be 0 (off, the default, or an index), ``secret`` hides it in repr,
    ``device`` checks it against :data:`DEVICE` (a choice's values are its enum's), ``below``
    bounds a number from above (exclusive)."""
    meta = {"flat": flat, "zero_ok": zero_ok, "secret": secret, "device": device,
            "below": below}
    return field(default=default, metadata=meta)


def section_fields(section: type) -> Iterator[tuple[str, Field[Any]]]:
    """(flat name, field) of each field a section declares."""
    prefix = getattr(section, "PREFIX", "")
    for f in fields(section):
        yield (f.metadata.get("flat") or prefix + f.name), f


@dataclass(frozen=True)
class BrokerSettings:
    """Broker and storage: where the run lives and how Celery delivers (the same everywhere)."""

    url: str = setting("redis://127.0.0.1:6379/0", flat="broker_url")
    storage: str = ".dflash/storage"
    # Celery re-delivers an unacked message after this many seconds: keep it above the longest
    # shard, and identical in producer, workers and Flower (the shortest one wins).
    visibility_timeout: int = 6 * 3600
    result_expires: int = 24 * 3600   # seconds Celery keeps a task result (a pointer to storage)
    soft_shutdown_timeout: float = 60.0   # seconds a stopping worker gets to flush its last part


@dataclass(frozen=True)
class WorkerSettings:
    """What every stage's worker uses: shard leases, redelivery, its GPU and metrics port."""

    lease_ttl: float = 60.0   # seconds a shard lease lives unrenewed (reconciler: every half)
    max_deliveries: int = 5   # deliveries of a shard before it is parked with its reason
    retry_backoff_max: float = 60.0   # cap, in seconds, of the backoff between retries
    gpu: int = setting(0, zero_ok=True)
    metrics_port: int = setting(0, zero_ok=True)   # 0: no Prometheus endpoint
    # The address the Prometheus endpoint listens on: loopback unless said otherwise (no auth).
    metrics_host: str = "127.0.0.1"


@dataclass(frozen=True)
class TargetSettings:
    """The target model every stage loads, and where built artefacts are cached."""

    model: str = TINY_MODEL
    cache_dir: Path = default_cache_dir()   # embedded models (and, by default, engine state)
    # Where engine servers' pid files and logs go ("": cache_dir/engines); compose points it at
    # a volume of its own, so the model cache can be read-only for every service that only reads.
    engine_dir: str = ""


@dataclass(frozen=True)
class GenerateSettings:
    """The generate stage: its parts and engine."""

    part_samples: int = 64   # a part is written every so many samples...
    part_seconds: float = 60.0   # ...or every so many seconds, whichever comes first
    batch_size: int = 16   # sequences the CPU engine decodes at once
    engine: EngineKind = EngineKind.CPU
    # SGLang engine: an external server (engine_url) or one the worker starts (engine_cmd, or
    # `python -m sglang.launch_server` built from model/tp/mem_fraction_static/engine_args).
    engine_url: str = ""
    engine_cmd: str = ""
    engine_args: str = ""
    # Generation through the target's own MTP head (SGLang's NEXTN): auto is on where the target
    # states one and SGLang runs on a GPU (common/engine/mtp.py says why, in the worker's start
    # line).
    mtp: MtpMode = MtpMode.AUTO
    # Seconds a task of a run needing the other MTP configuration waits (from its arrival or the
    # engine's last launch) before the engine is switched for it; tasks of the running one keep
    # it meanwhile, so runs alternating in the queue do not flip it (0: switch once it drains).
    mtp_switch_dwell: float = setting(120.0, zero_ok=True)
    # Under auto with no bench verdict for this worker, seconds of each configuration's window
    # when the worker measures MTP on against off on the run's own shards (a listing of the
    # run's verdicts is kept at most 60 s, or this window if shorter).
    mtp_measure_window: float = setting(180.0)
    # The share by which MTP on or off must beat the other, over repeated steady windows, to be
    # a verdict's winner (bench stores it in the verdict); within it the running one stays.
    mtp_margin: float = setting(0.05, zero_ok=True, below=1.0)
    # The python that runs `-m sglang.launch_server` (SGLang in a venv of its own); empty: the
    # worker's own.
    engine_python: str = ""
    engine_port: int = 30000   # the SGLang server of GPU N listens on this + N
    tp: int = 1
    mem_fraction_static: str = ""
    max_in_flight: int = 128
    engine_startup_timeout: float = 900.0   # seconds an engine may take to answer /health
    # On a stop SGLang finishes the requests it runs (SIGTERM), then the tree is killed.
    engine_drain_timeout: float = 30.0
    request_timeout: float = 3600.0   # seconds one /generate request may take


@dataclass(frozen=True)
class HiddenSettings:
    """The hidden stage: target hidden-state extraction."""

    PREFIX: ClassVar[str] = "hidden_"
    batch_tokens: int = 32768
    device: str = setting("auto", device=True)   # where the target runs: auto is CUDA if visible
    part_bytes: int = 512 * 2**20   # bytes of a safetensors part, about


@dataclass(frozen=True)
class TrainSettings:
    """The train stage: the drafter's steps, checkpoints, eval and data-parallel layout."""

    PREFIX: ClassVar[str] = "train_"
    checkpoint_steps: int = 50
    rows_per_step: int = 8
    # 0: the schedule comes from the run's data (epochs x training rows / rows per step);
    # N: an explicit length, and training ends there even with data left (it says so).
    total_steps: int = setting(0, zero_ok=True)
    min_supervised_tokens: int = setting(0, zero_ok=True)   # 0: two blocks' worth
    max_anchors: int = 512   # blocks drawn per row and step (DFlash's 512)
    # Padded target tokens and draft positions a micro-batch holds (0: the memory plan's budget
    # on a GPU, 32768 on the CPU); a row above it goes alone.
    batch_tokens: int = setting(0, zero_ok=True)
    # Recompute the drafter's layers in the backward: auto (where a micro-batch would not fit
    # without, by the memory plan), on, off.
    activation_checkpointing: Checkpointing = Checkpointing.AUTO
    # Share of the GPU's reported memory the memory plan leaves free (budget, checkpointing).
    memory_margin: float = setting(0.08, zero_ok=True, below=0.5)
    eval_steps: int = setting(200, zero_ok=True)   # speculative-decoding eval every N (0: off)
    eval_prompts: int = 8
    eval_max_new_tokens: int = 256
    # The device the target and drafter train and are judged on (eval-drafter too).
    device: str = setting("auto", device=True)
    # Data-parallel training (torch.distributed): ranks per host, hosts, this host's rank, and
    # the rank-0 host's HOST:PORT that the hosts meet at (unset on one host).
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = setting(0, zero_ok=True)
    rdzv_endpoint: str = ""
    parallel: str = "ddp"   # ddp: a drafter replica per rank; fsdp: FSDP2 shards
    # Train workers also write per-step metrics there when set.
    tensorboard_dir: str = setting("", flat="tensorboard_dir")


@dataclass(frozen=True)
class ReadSettings:
    """Bounds on what a reader takes from storage (common/reads.py): an object past them is
    foreign, never read whole (a forged object cannot fill a reader's memory)."""

    PREFIX: ClassVar[str] = "read_"
    json_bytes: int = 64 * 2**20            # a JSON record: run.json, commits, gates, ...
    index_bytes: int = 16 * 2**20           # a run-index object as stored (zstd)
    index_decoded_bytes: int = 64 * 2**20   # ... and decompressed
    part_bytes: int = 2**30                 # a part or an input shard as stored (zstd)
    part_decoded_bytes: int = 4 * 2**30     # ... and decompressed
    # Lines (blank ones too) of a part or input shard where its run's shard size is not at
    # hand (common/row_caps.py): a JSONL object is streamed and cut past its caps.
    part_rows: int = 1_000_000
    row_bytes: int = 64 * 2**20             # one line of a part or input shard


@dataclass(frozen=True)
class UiSettings:
    """The dashboard server."""

    PREFIX: ClassVar[str] = "ui_"
    auth: str = setting("", secret=True)   # user:password of its basic auth (like Flower's)
    # The networks whose engine URLs (announced in Redis) the dashboard probes, comma-separated:
    # loopback and the private ranges a compose network takes; nothing else is fetched.
    engine_networks: str = ("127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,"
                            "fc00::/7")


SECTIONS: dict[str, type] = {
    "broker": BrokerSettings, "worker": WorkerSettings, "target": TargetSettings,
    "generate": GenerateSettings, "hidden": HiddenSettings, "train": TrainSettings,
    "read": ReadSettings, "ui": UiSettings,
}
FIELDS: dict[str, tuple[str, Field[Any]]] = {
    flat: (section, f) for section, cls in SECTIONS.items() for flat, f in section_fields(cls)
}
"""Every setting by flat name: (its section, its field)."""


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

    def __init__(self, **values: Any) -> None:
        """Sections by name and fields by flat name (``model=``: what ``replace`` passes too);
        a flat value wins over its section's."""
        for name, cls in SECTIONS.items():
            section = values.pop(name, None) or cls()
            flat = {f.name: _as_field(values.pop(key), f) for key, f in section_fields(cls)
                    if key in values}
            object.__setattr__(self, name, replace(section, **flat) if flat else section)
        if values:
            raise TypeError(f"unknown settings: {', '.join(sorted(values))}")

    def replace(self, **flat: Any) -> Settings:
        """These settings with fields given by flat name (``model=``, ``train_nnodes=``)."""
        return replace(self, **flat)

    def __repr__(self) -> str:
        shown = ", ".join(f"{flat}={self._shown(flat)!r}" for flat in FIELDS)
        return f"Settings({shown})"

    def _shown(self, name: str) -> str:
        section, f = FIELDS[name]
        value = str(getattr(getattr(self, section), f.name))
        return "***" if f.metadata.get("secret") and value else mask_url(value)

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
        return self.target.model in TINY_MODELS


def _as_field(value: Any, f: Field[Any]) -> Any:
    """A choice given as its text (a keyword, ``replace``) as its enum's member; a number that
    is not finite refused (a click ``FloatRange`` lets NaN through, which no bound stops)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{f.name}={value!r} is not a finite number")
    return type(f.default)(value) if isinstance(f.default, Enum) else value


def _coerce(name: str, raw: str, f: Field[Any]) -> object:
    """A variable's text as its field's type; the error is one line naming the variable."""
    kind: Any = type(f.default)
    if issubclass(kind, Enum):
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(f"{env_name(name)}={raw!r} is not one of "
                              f"{', '.join(member.value for member in kind)}") from None
    try:
        value = kind(raw) if kind is not Path else Path(raw).expanduser()
    except ValueError as exc:
        raise ConfigError(f"{env_name(name)}={raw!r} is not a valid {kind.__name__}") from exc
    meta = f.metadata
    if isinstance(value, float) and not math.isfinite(value):   # NaN compares false to bounds
        raise ConfigError(f"{env_name(name)}={raw!r} is not a finite number")
    if isinstance(value, int | float) and (value < 0 or (value == 0 and not meta.get("zero_ok"))):
        raise ConfigError(f"{env_name(name)}={raw!r} must be positive")
    if meta.get("below") is not None and not value < meta["below"]:   # NaN too
        raise ConfigError(f"{env_name(name)}={raw!r} must be below {meta['below']}")
    if meta.get("device") and not DEVICE.fullmatch(str(value)):
        raise ConfigError(f"{env_name(name)}={raw!r} is not a device: {DEVICES}")
    return value


def load_settings(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Read settings from ``DFLASH_*`` variables; explicit overrides (CLI options) win."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for name, (_, f) in FIELDS.items():
        raw = env.get(env_name(name))
        if raw not in (None, ""):
            values[name] = _coerce(name, raw, f)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)

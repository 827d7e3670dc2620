"""``dflash-pipeline plan-storage``: what offline hidden states would weigh, and whether to train
online instead.

    dflash-pipeline plan-storage --samples 902087 --mean-tokens 3000 --hidden 5120 --layers 5
    dflash-pipeline plan-storage --run my-run --json

bytes = samples x mean tokens x hidden x K x dtype bytes (bf16/fp16 2, fp32 4, fp8 1); online
training stores none. With ``--run`` the figures come from storage: samples from the inputs
manifest (rows - rejected), mean tokens from the committed generated shards' stats, hidden size
and layer count from the run's model; any option given overrides what the run says.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import click

from common import keys
from common.cli import FiniteRange, options_for
from common.config import Settings, load_settings
from common.declared import opt
from common.engine.target import TargetShape
from common.errors import ConfigError, DflashError
from common.exit_codes import EXIT_FAILURE
from common.runs.commit_cache import read_commits
from common.storage import Storage, open_storage

log = logging.getLogger(__name__)

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
ONLINE_ABOVE_BYTES = 10**12
"""Above this much offline storage (1 TB) online training is recommended."""
DEFAULT_SHARD_SIZE = 1000
DEFAULT_LAYERS = 5


@dataclass(frozen=True)
class StoragePlan:
    """Offline hidden-state storage for a dataset, per token, sample, shard and in total."""

    samples: int
    mean_tokens: float
    hidden_size: int
    layers: int
    dtype: str
    shard_size: int
    bytes_per_token: int
    bytes_per_sample: int
    bytes_per_shard: int
    shards: int
    total_bytes: int
    online_bytes: int
    recommendation: str
    reason: str
    sources: dict[str, str] = field(default_factory=dict)
    run: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_tb": round(self.total_bytes / 1e12, 3),
                "total_tib": round(self.total_bytes / 2**40, 3),
                "total_human": human_bytes(self.total_bytes)}


def _scaled(n: float, base: int, units: tuple[str, ...]) -> str:
    power = 0
    while power + 1 < len(units) and n >= base ** (power + 1):
        power += 1
    return f"{n:.0f} {units[0]}" if power == 0 else f"{n / base**power:.1f} {units[power]}"


def human_bytes(n: float) -> str:
    """Decimal and binary units with one decimal, e.g. ``138.6 TB (126.0 TiB)``."""
    decimal = _scaled(n, 1000, ("B", "KB", "MB", "GB", "TB", "PB", "EB"))
    binary = _scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"))
    return f"{decimal} ({binary})"


def storage_plan(samples: int, mean_tokens: float, hidden: int, layers: int, dtype: str = "bf16",
                 shard_size: int = DEFAULT_SHARD_SIZE,
                 online_above: int = ONLINE_ABOVE_BYTES) -> StoragePlan:
    """The storage plan for these figures; raises ConfigError on unusable values."""
    for name, value in (("samples", samples), ("mean tokens", mean_tokens), ("hidden", hidden),
                        ("layers", layers), ("shard size", shard_size)):
        if not value > 0:
            raise ConfigError(f"{name} must be positive, not {value!r}")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    per_token = hidden * layers * DTYPE_BYTES[dtype]
    total = round(samples * mean_tokens * per_token)
    if total > online_above:
        recommendation = "online"
        reason = (f"offline hidden states would take {human_bytes(total)}, more than "
                  f"{human_bytes(online_above)}; online training computes them on the fly "
                  "with the target model and stores 0 bytes, at the cost of a target forward "
                  "per training step")
    else:
        recommendation = "offline"
        reason = (f"{human_bytes(total)} fits on ordinary disks; storing the hidden states lets "
                  "several epochs or drafters reuse them without running the target again")
    return StoragePlan(
        samples=samples, mean_tokens=mean_tokens, hidden_size=hidden, layers=layers, dtype=dtype,
        shard_size=shard_size, bytes_per_token=per_token,
        bytes_per_sample=round(mean_tokens * per_token),
        bytes_per_shard=round(min(shard_size, samples) * mean_tokens * per_token),
        shards=math.ceil(samples / shard_size), total_bytes=total, online_bytes=0,
        recommendation=recommendation, reason=reason,
    )


@dataclass(frozen=True)
class RunFigures:
    """What a run's storage says about its size; None where it does not say yet."""

    samples: int | None = None
    mean_tokens: float | None = None
    shard_size: int | None = None
    model: str | None = None


def read_run_figures(storage: Storage, run: str) -> RunFigures:
    """Samples from the inputs manifest, mean tokens from generated commits, run.json's model."""
    from producer.enqueue import read_manifest, read_run_config

    config = read_run_config(storage, run)
    if config is None:
        raise ConfigError(f"run {run!r} not found in {storage.root} (no run.json)")
    manifest = read_manifest(storage, run)
    samples = manifest.rows - manifest.rejected if manifest else None
    count = tokens = 0
    commits = [key for key in storage.list(keys.generated_prefix(run))
               if keys.commit_shard(key) is not None]
    for commit in read_commits(storage, commits):   # bounded, typed; a foreign one left out
        count += commit.stats.get("samples", 0)
        tokens += commit.stats.get("prompt_tokens", 0) + commit.stats.get("completion_tokens", 0)
    mean = tokens / count if count else None
    return RunFigures(samples=samples, mean_tokens=mean, shard_size=config.shard_size,
                      model=config.model)


def model_dims(settings: Settings, model: str) -> tuple[int, int]:
    """(hidden size, decoder layers) of the model, as :class:`common.engine.target.TargetShape`
    reads them (``text_config`` when nested)."""
    from common.engine.models import resolve_model_path

    settings = settings.replace(model=model)
    if settings.model_is_tiny:
        click.echo("Preparing the embedded CPU model (built once, then cached)...", err=True)
    path = resolve_model_path(settings)
    shape = TargetShape.from_dir(path)
    return shape.hidden_size, shape.num_layers


def render_plan(plan: StoragePlan) -> str:
    tokens = f"{plan.mean_tokens:,.0f}" if plan.mean_tokens == int(plan.mean_tokens) \
        else f"{plan.mean_tokens:,.1f}"
    source = f"run {plan.run}: " if plan.run else ""
    lines = [
        f"{source}{plan.samples:,} samples x {tokens} mean tokens, hidden {plan.hidden_size}, "
        f"K={plan.layers}, {plan.dtype}",
        f"  per token   {human_bytes(plan.bytes_per_token)}",
        f"  per sample  {human_bytes(plan.bytes_per_sample)}",
        f"  per shard   {human_bytes(plan.bytes_per_shard)}  ({plan.shard_size:,} samples, "
        f"{plan.shards:,} shards)",
        f"  offline     {human_bytes(plan.total_bytes)}",
        "  online      0 B (hidden states computed during training, never stored)",
        f"recommendation: {plan.recommendation} training: {plan.reason}",
    ]
    if plan.sources:
        lines.append("  from: " + ", ".join(f"{k} {v}" for k, v in sorted(plan.sources.items())))
    return "\n".join(lines)


def _pick(option: Any, from_run: Any, name: str, sources: dict[str, str], where: str) -> Any:
    if option is not None:
        sources[name] = "option"
        return option
    if from_run is not None:
        sources[name] = where
    return from_run


@dataclass(frozen=True, kw_only=True)
class PlanStorageOptions:
    """``plan-storage``'s own options."""

    samples: int | None = opt(
        None, commands=("plan-storage",), type=click.IntRange(min=1),
        help="Training samples.")
    mean_tokens: float | None = opt(
        None, commands=("plan-storage",), type=FiniteRange(min=0, min_open=True),
        help="Mean tokens per sample (prompt + response).")
    hidden: int | None = opt(
        None, commands=("plan-storage",), type=click.IntRange(min=1),
        help="Target hidden size.")
    layers: int | None = opt(
        None, commands=("plan-storage",), type=click.IntRange(min=1),
        help=f"Target layers kept per token, K [default: {DEFAULT_LAYERS}; EAGLE-3: 4].")
    dtype: str = opt(
        "bf16", commands=("plan-storage",), type=click.Choice(sorted(DTYPE_BYTES)),
        help="Stored dtype.")
    shard_size: int | None = opt(
        None, commands=("plan-storage",), type=click.IntRange(min=1),
        help=f"Samples per shard [default: the run's, else {DEFAULT_SHARD_SIZE}].")


@click.command("plan-storage")
@options_for("plan-storage", PlanStorageOptions)
def plan_storage(run: str | None, samples: int | None, mean_tokens: float | None,
                 hidden: int | None, layers: int | None, dtype: str, shard_size: int | None,
                 storage: str | None, as_json: bool) -> None:
    """Estimate offline hidden-state storage (total, per shard) and recommend online or offline."""
    sources: dict[str, str] = {}
    try:
        if run is None:
            if None in (samples, mean_tokens, hidden):
                raise click.UsageError("give --run RUN, or --samples, --mean-tokens and --hidden "
                                       "(with --layers, default 5)")
        else:
            if not keys.valid_run_id(run):
                raise click.BadParameter(f"invalid run id {run!r}", param_hint="--run")
            settings = load_settings(storage=storage)
            figures = read_run_figures(open_storage(settings.broker.storage, settings.read), run)
            samples = _pick(samples, figures.samples, "samples", sources, "inputs manifest")
            mean_tokens = _pick(mean_tokens, figures.mean_tokens, "mean_tokens", sources,
                                "generated commits")
            shard_size = _pick(shard_size, figures.shard_size, "shard_size", sources, "run.json")
            missing = [n for n, v in (("--samples", samples), ("--mean-tokens", mean_tokens))
                       if v is None]
            if missing:
                raise ConfigError(f"run {run!r} does not say yet (no inputs manifest or no "
                                  f"committed generated shard); pass {' and '.join(missing)}")
            if hidden is None:
                hidden, num_layers = model_dims(settings, figures.model or settings.target.model)
                sources["hidden_size"] = f"model {figures.model}"
                if layers is not None and layers > num_layers:
                    raise ConfigError(f"--layers {layers} exceeds the model's {num_layers}")
        if samples is None or mean_tokens is None or hidden is None:   # (checked above)
            raise ConfigError("the plan needs samples, mean tokens and the hidden size")
        plan = storage_plan(samples, mean_tokens, hidden, layers or DEFAULT_LAYERS, dtype,
                            shard_size or DEFAULT_SHARD_SIZE)
    except DflashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    plan = replace(plan, sources=sources, run=run)
    click.echo(json.dumps(plan.to_json(), sort_keys=True) if as_json else render_plan(plan))


"""``dflash-pipeline doctor``: every preflight check in one table, with a fix for each problem.

    dflash-pipeline doctor                      # checks what the DFLASH_* variables configure
    dflash-pipeline doctor --storage s3://bucket/prefix --broker-url redis://:pw@host:6379/0
    dflash-pipeline doctor --model /models/Qwen3-8B --gpus 0,1 --json
    dflash-pipeline doctor --model /models/Qwen3-8B --drafter out/drafter   # before serving it

Exit code 0 when no check FAILs (WARN is fine), 1 otherwise. ``--json`` prints one object:
``{"ok": bool, "checks": [{"name", "status", "ok", "warn", "detail", "fix"}]}``. ``producer.cli``
registers the command with ``main.add_command(doctor_command(common_options))``. On a GPU host
it also reports SGLang (installed, importable, the pinned release), NVML and each GPU's free
memory (:mod:`producer.doctor.gpu_host`), and for a hybrid (Qwen3.5/3.6) target served with
DFLASH whether SGLang's mamba state cache would cap its concurrency; ``--drafter`` adds the export
checks of :mod:`producer.doctor.drafter_check` against the target and, when they pass, the
DFLASH launch line (``serve-command dflash``). For a hybrid target it says which kernels its
Gated DeltaNet layers run on here (:mod:`producer.doctor.kernels`), warning on the torch fallback.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from common.choices import EngineKind
from common.cli import options_for
from common.config import Settings
from common.declared import opt
from common.engine.preflight import (
    CheckResult,
    NoNvidiaDriver,
    check_disk,
    check_gpu_clean,
    check_redis,
    no_driver_result,
    visible_gpus,
)
from common.errors import ConfigError
from common.exit_codes import EXIT_FAILURE
from common.keys import valid_run_id
from producer.doctor.storage import check_storage
from producer.doctor.target import target_dir

log = logging.getLogger(__name__)

_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
_DOWNLOAD_FIX = ("download it first (e.g. `huggingface-cli download Qwen/Qwen3-8B --local-dir "
                 "DIR`) and pass --model DIR / DFLASH_MODEL")


def check_model(settings: Settings) -> CheckResult:
    """The target model directory has a config, a tokenizer, a chat template and weights."""
    path, present = target_dir(settings)
    if settings.model_is_tiny and not present:
        return CheckResult("model", ok=True, warn=True,
                           detail=f"{settings.target.model} is not cached in "
                                  f"{settings.target.cache_dir}: will be built on first use "
                                  "(1-3 min)",
                           fix="nothing to do; set DFLASH_CACHE_DIR to share one cache")
    return check_model_dir(path)


def check_drafter_export(settings: Settings, drafter: Path) -> list[CheckResult]:
    """The drafter export rows, against the configured target."""
    from producer.doctor.drafter_check import check_drafter

    path, present = target_dir(settings)
    if not present:
        return [CheckResult("drafter target", ok=False, detail=f"target {path} is not there",
                            fix=f"pass the target the drafter was trained on: {_DOWNLOAD_FIX}")]
    results = check_drafter(drafter, path)
    if all(r.ok for r in results):
        results.append(serve_line(settings, drafter))
    return results


def serve_line(settings: Settings, drafter: Path) -> CheckResult:
    """The DFLASH launch line for a drafter that passed its checks (``serve-command dflash``)."""
    from producer.doctor.serve_command import build

    line = build(settings, "dflash", drafter, settings.generate.max_in_flight)
    return CheckResult("drafter serve line", ok=True, detail=line["command"],
                       fix=f"DFLASH_ENGINE_ARGS={shlex.quote(line['engine_args'])} makes a "
                           "generate worker (--engine sglang) start it")


def _gpu_host(settings: Settings) -> bool:
    """SGLang is configured here, or NVML sees a GPU."""
    if settings.generate.engine is EngineKind.SGLANG:
        return True
    try:
        return bool(visible_gpus())
    except NoNvidiaDriver:
        return False


def check_mamba(settings: Settings, drafter: Path | None) -> list[CheckResult]:
    """On a GPU host serving a hybrid target with DFLASH: would the mamba cache cap it?"""
    from common.engine.target import TargetShape
    from producer.doctor.gpu_host import check_mamba_cache
    from producer.doctor.serve_command import drafter_block_size

    path, present = target_dir(settings)
    if not present or not (path / "config.json").is_file() or not _gpu_host(settings):
        return []
    block = None
    if drafter is not None:
        try:
            block = drafter_block_size(drafter)
        except ConfigError:
            block = None   # the drafter rows say what is wrong with it
    row = check_mamba_cache(TargetShape.from_dir(path), settings.generate.engine_args,
                            settings.generate.max_in_flight, block)
    return [row] if row is not None else []


def check_engine_leftovers(settings: Settings) -> list[CheckResult]:
    """Engine servers that no live worker owns: each with the command that stops it."""
    from common.engine.leftovers import leftover_engines

    found = leftover_engines(settings.engines_dir)
    if not found:
        return [CheckResult("engine leftovers", ok=True,
                            detail="no engine server outlived its worker")]
    # One found through a worker's pid file is surely an orphan; one found by the scan may be
    # a server the user runs for --engine-url.
    return [CheckResult(f"engine leftover (pgid {left.pgid})", ok=left.source == "process scan",
                        warn=True,
                        detail=f"{left.command} (pids {', '.join(map(str, left.pids))}; no "
                               f"live worker owns it; found through {left.source})",
                        fix=f"stop it: {left.stop_command}")
            for left in found]


def check_model_dir(path: Path) -> CheckResult:
    """What a worker needs from a Hugging Face model directory, before it loads anything."""
    from common.engine.models import chat_template_of

    if not path.is_dir():
        return CheckResult("model", ok=False, detail=f"{path} is not a directory",
                           fix=_DOWNLOAD_FIX)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model",
                                                     "vocab.json")):
        missing.append("tokenizer (tokenizer.json / tokenizer.model / vocab.json)")
    try:
        if chat_template_of(path) is None:
            missing.append("chat template (chat_template.jinja or tokenizer_config.json)")
    except (OSError, ValueError) as exc:
        missing.append(f"a readable tokenizer_config.json ({exc})")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("weights (*.safetensors / *.bin)")
    if missing:
        return CheckResult("model", ok=False, detail=f"{path} lacks {'; '.join(missing)}",
                           fix=f"re-download the model completely; {_DOWNLOAD_FIX}")
    return CheckResult("model", ok=True, detail=f"{path}: config, tokenizer, chat template, "
                                                "weights")


def check_gpus(gpus: list[int] | None) -> list[CheckResult]:
    """One clean-GPU check per requested (default: every visible) GPU."""
    try:
        visible = visible_gpus()
    except NoNvidiaDriver as exc:  # one row, not one per requested GPU
        return [no_driver_result("gpu", exc, require_driver=False)]
    indices = visible if gpus is None else gpus
    if not indices:
        return [CheckResult("gpu", ok=True, warn=True, detail="NVML sees no GPU: only "
                            "--engine cpu can run", fix="check CUDA_VISIBLE_DEVICES")]
    return [check_gpu_clean(gpu) for gpu in indices]


def check_redis_binary() -> CheckResult:
    """``demo`` and the test suite start their own redis-server."""
    found = shutil.which("redis-server")
    if found:
        return CheckResult("redis-server binary", ok=True, detail=found)
    return CheckResult("redis-server binary", ok=True, warn=True,
                       detail="not on PATH: `dflash-pipeline demo` and the tests need it",
                       fix="apt-get install -y redis-server")


def run_checks(settings: Settings, gpus: list[int] | None,
               drafter: Path | None = None, run: str | None = None) -> list[CheckResult]:
    """Every check, in the order a deployment needs them; one broken check never hides others."""
    from producer.doctor.gpu_host import check_nvml, check_sglang
    from producer.doctor.kernels import check_linear_attention_kernels
    from producer.doctor.training import check_training

    checks: list[tuple[str, Callable[[], CheckResult | list[CheckResult]]]] = [
        ("redis", lambda: check_redis(settings.broker.url)),
        ("storage", lambda: check_storage(settings.broker.storage)),
        ("model", lambda: check_model(settings)),
        ("sglang", check_sglang),
        ("nvml", check_nvml),
        ("gpu", lambda: check_gpus(gpus)),
        ("disk (model cache)", lambda: check_disk("disk (model cache)", settings.target.cache_dir)),
    ]
    if not settings.storage_is_s3:
        checks.append(("disk (storage)", lambda: check_disk("disk (storage)",
                                                           Path(settings.broker.storage))))
    checks.append(("engine leftovers", lambda: check_engine_leftovers(settings)))
    checks.append(("redis-server binary", check_redis_binary))
    if drafter is not None:
        checks.append(("drafter", lambda: check_drafter_export(settings, drafter)))
    checks.append(("mamba state cache", lambda: check_mamba(settings, drafter)))
    checks.append(("linear-attention kernels", lambda: check_linear_attention_kernels(settings)))
    if run is not None:
        checks.append(("training memory", lambda: check_training(settings, run)))
    results: list[CheckResult] = []
    for name, check in checks:
        try:
            outcome = check()
        except Exception as exc:  # a bug in one check must not hide the verdicts of the rest
            log.exception("check %s crashed", name)
            outcome = CheckResult(name, ok=False, detail=f"{type(exc).__name__}: {exc}",
                                  fix="run with -v and report this as a bug")
        results.extend(outcome if isinstance(outcome, list) else [outcome])
    return results


def print_table(results: list[CheckResult]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Piped into a log: wrap less than rich's 80-column default would.
        console = Console(width=160)
    table = Table(title="dflash-pipeline doctor", show_lines=True)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for r in results:
        # Text, not markup: error messages contain brackets such as "[Errno 111]".
        table.add_row(Text(r.name), Text(r.status, style=_STYLE[r.status]), Text(r.detail),
                      Text(r.fix))
    console.print(table)
    counts = {s: sum(r.status == s for r in results) for s in _STYLE}
    console.print(f"{counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} failed")


def _parse_gpus(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None or value.strip().lower() in ("", "all"):
        return None
    try:
        gpus = [int(part) for part in value.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of GPU indices") from exc
    if any(g < 0 for g in gpus):
        raise click.BadParameter("GPU indices are >= 0")
    return gpus


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    """``doctor``'s own options."""

    gpus: list[int] | None = opt(
        None, commands=("doctor",), callback=_parse_gpus,
        help="Comma-separated GPU indices to check [default: all visible].")
    drafter: Path | None = opt(
        None, commands=("doctor",), type=click.Path(path_type=Path),
        help="Also check this drafter export (export-drafter --out) against the "
             "target before SGLang serves it.")


def doctor_command(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]
                   ) -> click.Command:
    """The ``doctor`` command, wrapped in the CLI's shared --storage/--broker-url options."""

    @click.command()
    @options_for("doctor", DoctorOptions)
    @common_options
    def doctor(settings: Settings, model: str | None, gpus: list[int] | None,
               drafter: Path | None, run: str | None, as_json: bool) -> None:
        """Check Redis, storage, the model, SGLang, GPUs, disk and a drafter; fix every problem."""
        if model:
            settings = settings.replace(model=model)
        if run is not None and not valid_run_id(run):
            raise click.BadParameter(f"invalid run id {run!r}", param_hint="--run")
        results = run_checks(settings, gpus, drafter, run)
        ok = all(r.ok for r in results)
        if as_json:
            click.echo(json.dumps({"ok": ok, "checks": [r.as_dict() for r in results]},
                                  sort_keys=True))
        else:
            print_table(results)
        if not ok:
            sys.exit(EXIT_FAILURE)

    return doctor

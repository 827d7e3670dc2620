"""What a GPU host needs before ``--engine sglang``: SGLang at the pinned release, NVML, memory.

    from producer.doctor.gpu_host import check_sglang, check_nvml
    for r in [check_sglang(), *check_nvml()]:
        print(r.status, r.name, r.detail, r.fix)

The pinned release is read from this package's own metadata (the ``gpu`` extra in
pyproject.toml, the one place it is written), so doctor never carries a second copy. On a host
without SGLang or without an NVIDIA driver the rows are WARN, not FAIL: the CPU engine needs
neither. :func:`check_mamba_cache` warns when SGLang's mamba state cache would cap DFLASH's
concurrency on a hybrid (Gated DeltaNet) target.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Iterable
from typing import Any

from common.engine.preflight import GIB, CheckResult, NoNvidiaDriver, no_driver_result, nvml_session
from common.engine.target import TargetShape

log = logging.getLogger(__name__)

PACKAGE = "dflash-pipeline"
INSTALL_FIX = ('pip install ".[gpu]"  (or `uv pip install --prerelease=allow ".[gpu]"`; '
               "SGLang needs the pre-release flash-attn-4), or use the pinned image "
               "(docker/Dockerfile)")
_PIN = re.compile(r"^sglang(\[[^\]]*\])?\s*==\s*([0-9][^;\s,]*)")


def pinned_sglang_version(requirements: Iterable[str] | None = None) -> str | None:
    """The ``sglang==X`` pin of the ``gpu`` extra, from requirement strings or our metadata."""
    if requirements is None:
        try:
            requirements = importlib.metadata.requires(PACKAGE) or []
        except importlib.metadata.PackageNotFoundError:
            return None
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        match = _PIN.match(spec.strip())
        if match and (not marker or re.search(r"extra\s*==\s*['\"]gpu['\"]", marker)):
            return match.group(2)
    return None


def check_sglang(pinned: str | None = None) -> CheckResult:
    """SGLang is installed, imports, and is the pinned release (``pinned`` defaults to ours)."""
    name = "sglang"
    pinned = pinned or pinned_sglang_version()
    want = f" (pinned: {pinned})" if pinned else ""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return CheckResult(name, ok=True, warn=True,
                           detail=f"not installed{want}: only --engine cpu can run",
                           fix=INSTALL_FIX)
    try:
        importlib.import_module("sglang")
    except Exception as exc:  # a broken install can raise anything (CUDA, ABI, missing libs)
        log.info("import sglang failed", exc_info=True)
        return CheckResult(name, ok=False,
                           detail=f"sglang {version} is installed but does not import: "
                                  f"{type(exc).__name__}: {exc}",
                           fix=f"reinstall: {INSTALL_FIX}")
    if pinned and version != pinned:
        return CheckResult(name, ok=True, warn=True,
                           detail=f"sglang {version} imports, but this release is pinned to "
                                  f"{pinned} (DFLASH, Qwen3.x): other releases are untested",
                           fix=f'pip install "sglang[all]=={pinned}" or {INSTALL_FIX}')
    return CheckResult(name, ok=True, detail=f"sglang {version} imports{want}")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_nvml() -> list[CheckResult]:
    """One row for NVML (driver, GPU count) and one per GPU with its name and free memory."""
    try:
        with nvml_session() as nvml:
            try:
                return _nvml_rows(nvml)
            except nvml.NVMLError as exc:
                return [CheckResult("nvml", ok=False, detail=f"NVML: {exc}",
                                    fix="check the driver with `nvidia-smi`")]
    except NoNvidiaDriver as exc:
        return [no_driver_result("nvml", exc, require_driver=False)]


def _nvml_rows(nvml: Any) -> list[CheckResult]:
    """The driver row and one free-memory row per GPU NVML sees."""
    count = nvml.nvmlDeviceGetCount()
    rows = [CheckResult("nvml", ok=True,
                        detail=f"driver {_text(nvml.nvmlSystemGetDriverVersion())}, "
                               f"{count} GPU(s)")]
    for gpu in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        free, total = memory.free / GIB, memory.total / GIB
        detail = f"{_text(nvml.nvmlDeviceGetName(handle))}: {free:.1f} of {total:.1f} GiB free"
        if free < 0.5 * total:
            rows.append(CheckResult(f"gpu {gpu} memory", ok=True, warn=True, detail=detail,
                                    fix="another process holds most of this GPU; "
                                        "`nvidia-smi` shows which"))
        else:
            rows.append(CheckResult(f"gpu {gpu} memory", ok=True, detail=detail))
    return rows


def check_mamba_cache(shape: TargetShape, engine_args: str, concurrency: int,
                      drafter_block_size: int | None = None) -> CheckResult | None:
    """Whether SGLang's mamba state cache would cap speculative concurrency on a hybrid target.

    SGLang gives each running request a fixed number of state slots (3, by its own ratio; up
    to 5 with the extra-buffer strategy) and fits the cache to free memory unless
    ``--max-mamba-cache-size`` says otherwise; an explicit size that holds fewer than the
    requests wanted (``--max-running-requests`` or the worker's in-flight cap) caps them. None
    when it does not apply: a dense target, or no speculative decoding and no drafter to serve.
    """
    from common.engine.serving import (
        mamba_slots_per_request,
        mamba_spec_states_per_request,
        spec_settings,
    )

    spec = spec_settings(engine_args)
    if not shape.is_hybrid or (spec.algorithm is None and drafter_block_size is None):
        return None
    name = "mamba state cache"
    running = spec.max_running_requests or concurrency
    ratio = mamba_slots_per_request(engine_args)
    per_request = f"{ratio} state slots per running request (SGLang's ratio)"
    drafts = mamba_spec_states_per_request(engine_args)
    if drafts:   # SGLang reserves them apart from the cache: per request x (running + 1) x D
        per_request += f", and {drafts} intermediate states while its drafts are verified"
    layers = f"{len(shape.linear_attention_layers)} linear-attention layers"
    if spec.max_mamba_cache_size is None:
        return CheckResult(name, ok=True,
                           detail=f"hybrid target ({layers}): SGLang fits the mamba state cache "
                                  f"to free memory, {per_request}; the worker reads back the "
                                  "running-request limit it settles on and keeps its in-flight "
                                  "cap at or below it")
    cap = spec.max_mamba_cache_size // ratio
    if cap < running:
        return CheckResult(name, ok=True, warn=True,
                           detail=f"--max-mamba-cache-size {spec.max_mamba_cache_size} caps "
                                  f"the engine at {cap} running requests of the {running} "
                                  f"wanted ({per_request}, {layers})",
                           fix="drop --max-mamba-cache-size from DFLASH_ENGINE_ARGS (SGLang "
                               "sizes the cache from free memory), or lower "
                               "--max-running-requests / DFLASH_MAX_IN_FLIGHT")
    return CheckResult(name, ok=True,
                       detail=f"--max-mamba-cache-size {spec.max_mamba_cache_size} holds "
                              f"{running} running requests ({per_request})")

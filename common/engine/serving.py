"""The SGLang launch lines this project builds: the worker's engine, MTP generation, DFLASH serving.

    argv = launch_argv("/models/Qwen3.6-27B", port=30000, tp=1)            # the worker's engine
    extra = mtp_engine_args(shape)              # DFLASH_ENGINE_ARGS for Qwen3.6 with its MTP head
    extra = dflash_engine_args("out/drafter", block_size=16)       # serve the trained drafter
    print(shell_line(launch_argv(model, engine_args=extra)))

Every flag is a name of the pinned release's ``server_args.py`` (tests/test_serving_lines.py
holds them to ``workers/generate/engines/sglang_args_<pin>.txt``). Pure functions of their
arguments: no SGLang import, so the CPU tests and ``doctor`` run them anywhere. Pools SGLang
sizes itself (the KV cache, a hybrid's mamba state cache) are never sized here: the worker reads
back the running-request limit the server settled on.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.choices import MambaStrategy, SpecAlgorithm
from common.config import Settings
from common.config_fields import SECRET_FLAGS
from common.engine.sampling import Sampling
from common.engine.target import NO_MTP_HEAD, TargetShape

DFLASH = "DFLASH"
NEXTN = SpecAlgorithm.NEXTN   # SGLang's name for a checkpoint's own MTP head as the draft
# SGLang's Qwen3.5/Qwen3-Next recipes: 3 MTP steps, a chain (top-1), 4 tokens verified per step.
MTP_STEPS, MTP_TOPK, MTP_DRAFT_TOKENS = 3, 1, 4
DFLASH_BLOCK_SIZE = 16
# SGLang's mamba state slots per running request (mem_cache/kv_cache_configurator.py
# _calculate_mamba_ratio: MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO), plus the extra buffer's
# tracking slots (mem_cache/allocation_sizing.py get_mamba_tracking_slots: 2 with the overlap
# scheduler, 1 without it or with extra_buffer_lazy); 1 without the radix cache. Speculative
# intermediate states are a separate allocation.
MAMBA_SLOTS_PER_REQUEST, MAMBA_EXTRA_BUFFER_SLOTS = 3, 2


def launch_argv(model: str | Path, *, host: str = "127.0.0.1", port: int = 30000, tp: int = 1,
                mem_fraction_static: str = "", engine_args: str | Sequence[str] = "",
                python: str = sys.executable,
                max_running_requests: int | None = None) -> list[str]:
    """``python -m sglang.launch_server --model-path M --host H --port P --tp-size N ...``.

    ``--enable-metrics`` always (the dashboard's Engines panel reads ``/metrics``, which exists
    only with it); with a speculative algorithm, ``--max-running-requests`` (SGLang caps such a
    server at 48 running requests otherwise) unless the engine args name it.
    """
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host,
            "--port", str(port), "--tp-size", str(tp), "--enable-metrics"]
    if mem_fraction_static:
        argv += ["--mem-fraction-static", str(mem_fraction_static)]
    return argv + engine_flags(engine_args, max_running_requests)


def engine_flags(engine_args: str | Sequence[str],
                 max_running_requests: int | None = None) -> list[str]:
    """What follows the launch line's fixed head (model, host, port, tp, metrics): the engine
    args and, with a speculative algorithm, ``--max-running-requests`` unless they name it."""
    extra = shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)
    spec = spec_settings(extra)
    if spec.algorithm and spec.max_running_requests is None and max_running_requests:
        extra += ["--max-running-requests", str(max_running_requests)]
    return [part for part in extra if part != "--enable-metrics"]


ENGINE_ARGS_FIELD = "{engine_args}"


def engine_command(settings: Settings, model_path: Path, mtp_args: Sequence[str] = (), *,
                   port: int | None = None,
                   max_running_requests: int | None = None) -> list[str]:
    """The engine a generate worker (or ``bench --run``) starts: ``DFLASH_ENGINE_CMD`` with its
    fields filled, else ``python -m sglang.launch_server ...``.

    ``mtp_args`` (:mod:`common.engine.mtp`) come before ``DFLASH_ENGINE_ARGS``;
    ``{engine_args}`` in a command is those flags and ``--max-running-requests`` (one word: spliced
    in as several), so a stand-in sees what SGLang would. ``{port}``, ``{model}``, ``{gpu}``,
    ``{tp}`` are filled in the command and the engine args alike.
    """
    port = settings.engine_server_port if port is None else port
    generate = settings.generate
    running = generate.max_in_flight if max_running_requests is None else max_running_requests
    fields = {"port": port, "model": model_path, "gpu": settings.worker.gpu, "tp": generate.tp}
    extra = [*mtp_args, *(filled(part, fields) for part in shlex.split(generate.engine_args))]
    if generate.engine_cmd:
        flags = engine_flags(extra, running)
        argv: list[str] = []
        for part in shlex.split(settings.generate.engine_cmd):
            if part == ENGINE_ARGS_FIELD:
                argv += flags
            else:
                argv.append(filled(part, {**fields, "engine_args": shlex.join(flags)}))
        return argv
    # One builder for this line and the printed serving lines; its flags are held to the pinned
    # release's own names (tests/test_serving_lines.py).
    return launch_argv(model_path, port=port, tp=settings.generate.tp,
                       mem_fraction_static=settings.generate.mem_fraction_static, engine_args=extra,
                       python=settings.generate.engine_python or sys.executable,
                       max_running_requests=running)


def filled(part: str, fields: dict[str, Any]) -> str:
    """``part`` with each ``{name}`` of ``fields`` replaced by its value and nothing else
    touched: an argument such as ``--json-model-override-args '{"rope_scaling": {...}}'`` keeps
    its braces (``str.format`` would take them for fields)."""
    for name, value in fields.items():
        part = part.replace("{" + name + "}", str(value))
    return part


def visible_devices(gpu: int, tp: int) -> str:
    """The GPUs an engine owns: ``gpu`` alone, or a tensor-parallel engine's ``tp`` from it."""
    return ",".join(str(gpu + i) for i in range(tp))


def sampling_params(sampling: Sampling, max_new_tokens: int,
                    stop_ids: Sequence[int] = ()) -> dict[str, Any]:
    """SGLang's ``sampling_params`` of a run's request (the worker's and ``bench --run``'s)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "skip_special_tokens": False,
    }
    if stop_ids:
        params["stop_token_ids"] = list(stop_ids)
    return params


def mtp_engine_args(shape: TargetShape, *, steps: int = MTP_STEPS, topk: int = MTP_TOPK,
                    draft_tokens: int = MTP_DRAFT_TOKENS,
                    max_running_requests: int | None = None) -> list[str]:
    """Generation with the target's own MTP head (Qwen3.5/3.6: ``mtp.*``), for DFLASH_ENGINE_ARGS.

    ``max_running_requests`` is passed on (a speculative server runs 48 otherwise); SGLang fits
    a hybrid's mamba state cache to it from free memory.
    """
    if not shape.has_mtp:
        raise ValueError(f"{NO_MTP_HEAD}: NEXTN speculative decoding needs one")
    args = ["--speculative-algorithm", NEXTN, "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens",
            str(draft_tokens)]
    return args + _concurrency_args(max_running_requests)


def dflash_engine_args(drafter: str | Path, *, block_size: int = DFLASH_BLOCK_SIZE,
                       max_running_requests: int | None = None) -> list[str]:
    """DFLASH serving of an ``export-drafter`` directory; ``block_size`` is the verify window."""
    args = ["--speculative-algorithm", DFLASH, "--speculative-draft-model-path", str(drafter),
            "--speculative-num-draft-tokens", str(block_size)]
    return args + _concurrency_args(max_running_requests)


def _concurrency_args(max_running_requests: int | None) -> list[str]:
    return [] if max_running_requests is None else ["--max-running-requests",
                                                    str(max_running_requests)]


def mamba_slots_per_request(engine_args: str | Sequence[str]) -> int:
    """State slots SGLang gives each running request of a hybrid target, by its own ratio and
    the strategy its flags resolve to on a GPU (``auto``: ``extra_buffer`` with the overlap
    scheduler, ``srt/arg_groups/overrides.py`` ``_mamba_radix_cache_resolution``)."""
    argv = shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)
    if "--disable-radix-cache" in argv:
        return 1
    strategy = MambaStrategy.parse(next((v for n, v in reversed(_flag_values(argv))
                                         if n == "--mamba-radix-cache-strategy"), "auto"))
    overlap = "--disable-overlap-schedule" not in argv
    if strategy is MambaStrategy.AUTO:   # SGLang on a GPU: extra_buffer with the overlap
        strategy = (MambaStrategy.EXTRA_BUFFER if overlap   # scheduler (overrides.py, line 477)
                    else MambaStrategy.NO_BUFFER)
    if strategy not in (MambaStrategy.EXTRA_BUFFER, MambaStrategy.EXTRA_BUFFER_LAZY):
        return MAMBA_SLOTS_PER_REQUEST
    lazy = strategy is MambaStrategy.EXTRA_BUFFER_LAZY
    return MAMBA_SLOTS_PER_REQUEST + (1 if lazy or not overlap else MAMBA_EXTRA_BUFFER_SLOTS)


def _flag_values(argv: list[str]) -> list[tuple[str, str]]:
    """``(--flag, value)`` pairs of ``argv``, in order (``--flag v`` and ``--flag=v``)."""
    pairs = []
    for i, part in enumerate(argv):
        name, eq, value = part.partition("=")
        if eq:
            pairs.append((name, value))
        elif part.startswith("--") and i + 1 < len(argv):
            pairs.append((name, argv[i + 1]))
    return pairs


def mamba_spec_states_per_request(engine_args: str | Sequence[str]) -> int:
    """Intermediate states a running request of a hybrid holds while its drafts are verified:
    one per draft token (SGLang reserves ``per_request x (running + 1) x draft_tokens``, apart
    from the slots above); 0 without speculative decoding."""
    spec = spec_settings(engine_args)
    if spec.algorithm is None:
        return 0
    return spec.draft_tokens or MTP_DRAFT_TOKENS


def shell_line(argv: Sequence[str]) -> str:
    """One copy-pasteable shell line."""
    return shlex.join(argv)


def shown_argv(argv: Sequence[str]) -> str:
    """The command line for logs, with the values of secret flags hidden."""
    shown, hide = [], False
    for part in argv:
        name, eq, _ = part.partition("=")
        shown.append("***" if hide else f"{name}=***" if eq and name in SECRET_FLAGS else part)
        hide = part in SECRET_FLAGS
    return shlex.join(shown)


@dataclass(frozen=True)
class SpecSettings:
    """What a launch line asks of SGLang's speculative decoding and scheduler."""

    algorithm: str | None
    draft_tokens: int | None
    max_running_requests: int | None
    max_mamba_cache_size: int | None


def spec_settings(engine_args: str | Sequence[str]) -> SpecSettings:
    """Read the speculative/scheduler flags out of ``DFLASH_ENGINE_ARGS`` (last one wins)."""
    argv = shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)
    values: dict[str, str] = {}
    for i, part in enumerate(argv):
        if part.startswith("--"):
            name, eq, value = part.partition("=")
            if eq:
                values[name] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                values[name] = argv[i + 1]

    def number(*names: str) -> int | None:
        for name in names:
            if name in values:
                try:
                    return int(values[name])
                except ValueError:
                    return None
        return None

    algorithm = values.get("--speculative-algorithm")
    return SpecSettings(
        algorithm=algorithm.upper() if algorithm else None,
        draft_tokens=number("--speculative-num-draft-tokens", "--speculative-dflash-block-size"),
        max_running_requests=number("--max-running-requests"),
        max_mamba_cache_size=number("--max-mamba-cache-size"))

"""Whether a generate worker (or ``bench --run``) generates through the target's own MTP head.

    choice = choose_mtp(settings, TargetShape.from_dir(model_dir))   # DFLASH_MTP: auto|on|off
    log.info(choice.line())          # "mtp on (auto): the target states an MTP head ... "
    argv = engine_command(settings, model_dir, choice.args)
    refusal = lossless_refusal(choice.algorithm, choice.device, run.sampling)   # per run

``auto`` is on where the target states an MTP head (:attr:`TargetShape.has_mtp`) and SGLang runs
on a GPU; the flags are :func:`common.engine.serving.mtp_engine_args` (SGLang's Qwen3.5/3.6 recipe)
plus what the pinned SGLang needs for a hybrid (:func:`hybrid_spec_args`). A user's own
``--speculative-*`` flags in ``DFLASH_ENGINE_ARGS`` win over all of it. ``on`` where MTP cannot
run (no head, the CPU engine, a server started elsewhere) is an :class:`OptionRefused` (one
``error:`` line, exit 2).

Lossless or refused: SGLang 0.5.23 verifies a draft in ``eagle_sample``
(``sglang/srt/speculative/eagle_utils.py``): ``_verify_uses_greedy`` (line 485) sends a batch to
the argmax branch (line 641-648: ``torch.argmax`` of the target's logits, drafts kept where they
equal it) when every request is greedy *or on the CPU engine* (``is_cpu``: SGLANG_USE_CPU_ENGINE,
``srt/utils/common.py`` line 221), whatever its temperature; on a GPU a sampled batch takes
``tree_speculative_sampling_target_only`` (line 718, or ``chain_speculative_sampling_triton``
with rejection sampling, line 715): rejection sampling against the target's probabilities,
which keeps its distribution. That kernel is CUDA's (``sglang/kernels/ops/speculative/
sampling.py``), so ``--device cpu`` has no lossless sampled verify either. Hence on the CPU only
greedy runs (temperature 0 or top-k 1) may use MTP: :func:`lossless_refusal` says why not.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.config import Settings
from common.engine.sampling import Sampling
from common.engine.serving import (
    ENGINE_ARGS_FIELD,
    MTP_DRAFT_TOKENS,
    MTP_STEPS,
    MTP_TOPK,
    mtp_engine_args,
    spec_settings,
)
from common.engine.target import NO_MTP_HEAD, TargetShape
from common.errors import OptionRefused

# Where the verify path decides (quoted by refusals and the docs).
VERIFY_SOURCE = "sglang/srt/speculative/eagle_utils.py:485 _verify_uses_greedy"
# SGLang resolves the hybrid's mamba radix cache "auto" to extra_buffer on a GPU with the overlap
# scheduler (srt/arg_groups/overrides.py _mamba_radix_cache_resolution); stated here, so the
# slots this project computes (common.engine.serving.mamba_slots_per_request: 3 + 2) are SGLang's.
MAMBA_STRATEGY = "extra_buffer"
# With extra_buffer SGLang asserts --mamba-track-interval >= the draft tokens
# (srt/arg_groups/mamba_hook.py validate_mamba_extra_buffer); its default is 256.
MAMBA_TRACK_INTERVAL_DEFAULT = 256
EAGLE_FAMILY = ("NEXTN", "EAGLE", "EAGLE3")


@dataclass(frozen=True)
class MtpChoice:
    """What a worker asked (``mode``), what it does (``on``, ``args``) and why, in one line."""

    mode: str
    on: bool
    reason: str
    device: str = "cuda"
    args: tuple[str, ...] = ()
    user_algorithm: str | None = None   # DFLASH_ENGINE_ARGS' own --speculative-algorithm

    @property
    def algorithm(self) -> str | None:
        """The speculative algorithm the engine is launched with (ours or the user's)."""
        return "NEXTN" if self.on else self.user_algorithm

    def line(self) -> str:
        return f"mtp {'on' if self.on else 'off'} ({self.mode}): {self.reason}"


def _argv(engine_args: str | Sequence[str]) -> list[str]:
    return shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)


def _value(argv: list[str], flag: str) -> str | None:
    for i, part in enumerate(argv):
        name, eq, value = part.partition("=")
        if name == flag:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def target_shape(model_dir: Path) -> TargetShape | None:
    """The target's shape, or None when its directory has no config.json to state one."""
    return TargetShape.from_dir(model_dir) if (model_dir / "config.json").is_file() else None


def engine_device(settings: Settings) -> str:
    """Where the engine runs: ``--device`` in the engine args, else SGLang's default, the GPU
    the worker owns (the CPU engine is ``cpu``)."""
    if settings.generate.engine != "sglang":
        return "cpu"
    device = _value(_argv(settings.generate.engine_args), "--device")
    return (device or "cuda").lower()


def hybrid_spec_args(shape: TargetShape, engine_args: str | Sequence[str],
                     draft_tokens: int = MTP_DRAFT_TOKENS) -> list[str]:
    """What the pinned SGLang needs beyond the NEXTN flags to verify drafts on a hybrid: the
    mamba radix cache strategy stated (unless the user's args name one, or no radix cache)."""
    argv = _argv(engine_args)
    if not shape.is_hybrid or "--disable-radix-cache" in argv:
        return []
    strategy = _value(argv, "--mamba-radix-cache-strategy")
    interval = _value(argv, "--mamba-track-interval")
    if (strategy in (None, "auto", "extra_buffer", "extra_buffer_lazy") and interval
            and interval.isdigit() and int(interval) < draft_tokens):
        raise OptionRefused(f"--mamba-track-interval {interval} is below the {draft_tokens} "
                            "draft tokens MTP verifies; SGLang refuses that with the "
                            "extra_buffer mamba cache (mamba_hook.py validate_mamba_extra_buffer)")
    return [] if strategy else ["--mamba-radix-cache-strategy", MAMBA_STRATEGY]


def choose_mtp(settings: Settings, shape: TargetShape | None) -> MtpChoice:
    """The worker's MTP decision from ``settings.generate.mtp`` and the target's own files
    (``shape``: its config.json; None where it has none, which states no head)."""
    mode, device = settings.generate.mtp, engine_device(settings)
    user = [p for p in _argv(settings.generate.engine_args) if p.startswith("--speculative-")]
    if user:
        algorithm = spec_settings(settings.generate.engine_args).algorithm
        return MtpChoice(mode, False, f"DFLASH_ENGINE_ARGS sets {user[0]} (the user's "
                                      "speculative flags win)", device, user_algorithm=algorithm)
    if mode == "off":
        return MtpChoice(mode, False, "asked off", device)
    refusal = _cannot(settings, shape)
    if refusal is not None:
        if mode == "on":
            raise OptionRefused(f"--mtp on: {refusal}")
        return MtpChoice(mode, False, refusal, device)
    if device == "cpu" and mode == "auto":
        return MtpChoice(mode, False, "SGLang runs on the CPU, where its verify commits the "
                         f"argmax even when sampling ({VERIFY_SOURCE}); --mtp on for greedy "
                         "runs", device)
    assert shape is not None   # _cannot: a head is stated
    args = [*mtp_engine_args(shape), *hybrid_spec_args(shape, settings.generate.engine_args)]
    where = "the GPU" if device != "cpu" else "the CPU (greedy runs only)"
    why = "asked on" if mode == "on" else "the target states an MTP head"
    return MtpChoice(mode, True, f"{why}, SGLang on {where}: NEXTN, {MTP_STEPS} steps, "
                                 f"top-{MTP_TOPK}, {MTP_DRAFT_TOKENS} tokens verified per step"
                                 + (" (hybrid: mamba radix cache extra_buffer)"
                                    if "--mamba-radix-cache-strategy" in args else ""),
                     device, tuple(args))


def _cannot(settings: Settings, shape: TargetShape | None) -> str | None:
    """Why this worker cannot generate through the MTP head, or None."""
    if settings.generate.engine != "sglang":
        return "the CPU engine has no speculative decoding (use --engine sglang)"
    if settings.generate.engine_url:
        return ("the server at --engine-url runs with the flags it was started with (start it "
                "with the NEXTN flags of `serve-command mtp`)")
    if settings.generate.engine_cmd and ENGINE_ARGS_FIELD not in settings.generate.engine_cmd:
        return f"--engine-cmd has no {ENGINE_ARGS_FIELD} field to pass the MTP flags"
    if shape is None or not shape.has_mtp:
        return NO_MTP_HEAD
    return None


def is_greedy(sampling: Sampling) -> bool:
    """SGLang's ``is_all_greedy`` for a request: temperature 0 (top-k 1) or top-k 1."""
    return sampling.temperature == 0 or sampling.top_k == 1


def lossless_refusal(algorithm: str | None, device: str, sampling: Sampling) -> str | None:
    """Why generating ``sampling`` through ``algorithm`` on ``device`` would change the
    target's distribution (the CPU verify commits the argmax), or None when it keeps it."""
    if algorithm is None or algorithm.upper() not in EAGLE_FAMILY or device != "cpu" \
            or is_greedy(sampling):
        return None
    return (f"{algorithm} on the CPU at temperature {sampling.temperature} would not keep the "
            f"target's distribution: SGLang's CPU verify commits the argmax even when sampling "
            f"({VERIFY_SOURCE}); use --mtp off, or a greedy run (temperature 0)")

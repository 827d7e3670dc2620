"""Whether SGLang's speculative verify keeps a run's sampling exactly, read from its source.

    platform = engine_platform(settings.generate.engine_args, os.environ)   # cpu, cuda, hip...
    why = lossless_refusal(SpecAlgorithm.NEXTN, platform, run.sampling, engine_args)  # None: ok

The pinned SGLang (0.5.23) verifies an EAGLE/NEXTN draft in ``eagle_sample``
(:data:`VERIFY`). What it applies exactly, for every request of a verified batch:

- **temperature, top-k, top-p**: on a platform with a sampled verify, rejection sampling against
  the target's probabilities, renormalised for top-k (line 728) and top-p (line 736): the
  target's distribution is kept; temperature 0 or top-k 1 is greedy (argmax, line 648), exact.
- **logit bias and a grammar**: added to the verified logits as to a plain step (lines 579-588).

What it does not:

- **min-p**: no renormalisation for it in the sampled verify (lines 728-743 handle top-k and
  top-p only; line 516 merely keeps min-p batches off the sparse path), so a sampled run with
  ``min_p > 0`` draws from a wider distribution than the target's. (A greedy run ignores min-p:
  the argmax always survives it.)
- **presence, frequency and repetition penalties**: "a relaxed version of penalties for
  speculative decoding" (line 563): the penalties are accumulated once per verify step
  (``eagle_prepare_for_decode``, line 861), so the drafts of one step do not penalise each other.
  Greedy runs too.
- **the argmax platforms**: ``_verify_uses_greedy`` (line 485-500) commits the argmax, whatever
  the sampling, on the CPU (``SGLANG_USE_CPU_ENGINE=1``, ``srt/utils/common.py`` line 221), on
  XPU, and on ROCm without ``--speculative-use-rejection-sampling``: only greedy runs are exact.
  Those three are all (line 500): an Ascend NPU verifies by sampling, through
  ``sgl_kernel_npu``'s ``tree_speculative_sampling_target_only``
  (``sglang/kernels/ops/speculative/verify_sampling.py`` lines 8-13), as CUDA does, so ``npu``
  is not refused for sampling (tests/test_mtp_choice.py holds this list to the pinned source).
- **acceptance thresholds** below 1 (``--speculative-accept-threshold-single/-acc``,
  ``srt/arg_groups/fields/spec.py`` line 109-116) accept drafts the target would not have drawn,
  and ``SGLANG_SIMULATE_ACC_LEN`` replaces the verify with a simulated acceptance (line 807).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.choices import SpecAlgorithm
from common.engine.sampling import Sampling

VERIFY = "sglang/srt/speculative/eagle_utils.py"
GREEDY_SOURCE = f"{VERIFY}:485 _verify_uses_greedy"
# Platforms whose verify commits the argmax even when sampling (GREEDY_SOURCE, line 500: its
# is_cpu, is_xpu and is_hip arguments; npu samples, see the module's docstring).
ARGMAX_PLATFORMS = {"cpu": "the CPU", "xpu": "XPU",
                    "hip": "ROCm without --speculative-use-rejection-sampling"}
ROCM_MARKERS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def _argv(engine_args: str | Sequence[str]) -> list[str]:
    return shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value ``flag`` is given in ``argv`` (``--flag v`` or ``--flag=v``), or None."""
    found = None
    for i, part in enumerate(argv):
        name, eq, value = part.partition("=")
        if name == flag:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def engine_platform(engine_args: str | Sequence[str], env: Mapping[str, str],
                    rocm_root: Path = Path("/opt/rocm")) -> str:
    """The platform SGLang will verify on, from its flags and environment: ``cpu``
    (``SGLANG_USE_CPU_ENGINE=1`` or ``--device cpu``), ``xpu``, ``hip`` (ROCm, unless its
    rejection sampling is asked for), else the device ``--device`` names (``cuda`` by default)."""
    argv = _argv(engine_args)
    if env.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        return "cpu"
    device = (flag_value(argv, "--device") or "cuda").lower()
    if device != "cuda":
        return device
    rocm = any(env.get(name) for name in ROCM_MARKERS) or rocm_root.is_dir()
    return "hip" if rocm and "--speculative-use-rejection-sampling" not in argv else "cuda"


def is_greedy(sampling: Sampling) -> bool:
    """SGLang's ``is_all_greedy`` for a request: temperature 0 (top-k 1) or top-k 1."""
    return sampling.temperature == 0 or sampling.top_k == 1


def inexact_parameters(sampling: Sampling) -> list[str]:
    """The run's sampling parameters SGLang's verify applies only approximately, as ``name
    value`` (empty: it keeps them all)."""
    found = []
    if sampling.min_p > 0 and not is_greedy(sampling):
        found.append(f"min_p {sampling.min_p:g} (no min-p renormalisation in the sampled "
                     f"verify, {VERIFY}:728-743)")
    if sampling.presence_penalty != 0:
        found.append(f"presence_penalty {sampling.presence_penalty:g} (penalties are relaxed "
                     f"under speculative decoding, {VERIFY}:563)")
    if sampling.repetition_penalty != 1:
        found.append(f"repetition_penalty {sampling.repetition_penalty:g} (penalties are "
                     f"relaxed under speculative decoding, {VERIFY}:563)")
    return found


def inexact_engine(engine_args: str | Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Engine settings under which no verify is exact (acceptance thresholds, a simulated
    acceptance)."""
    argv, found = _argv(engine_args), []
    for flag in ("--speculative-accept-threshold-single", "--speculative-accept-threshold-acc"):
        value = flag_value(argv, flag)
        try:
            if value is not None and float(value) < 1:
                found.append(f"{flag} {value} (accepts drafts below the target's probability)")
        except ValueError:
            continue
    if env.get("SGLANG_SIMULATE_ACC_LEN"):
        found.append("SGLANG_SIMULATE_ACC_LEN (a simulated acceptance, not a verify)")
    return found


def inexact(algorithm: str | None, platform: str, sampling: Sampling,
            engine_args: str | Sequence[str] = "",
            env: Mapping[str, str] | None = None) -> list[str]:
    """Each reason generating ``sampling`` through ``algorithm`` on ``platform`` would not
    keep the target's distribution (empty: it keeps it)."""
    if SpecAlgorithm.parse(algorithm) is None:   # not the EAGLE family: not verified here
        return []
    reasons = [*inexact_engine(engine_args, env or {}), *inexact_parameters(sampling)]
    if platform in ARGMAX_PLATFORMS and not is_greedy(sampling):
        reasons.append(f"temperature {sampling.temperature:g} on {ARGMAX_PLATFORMS[platform]}, "
                       f"where SGLang's verify commits the argmax even when sampling "
                       f"({GREEDY_SOURCE})")
    return reasons


def lossless_refusal(algorithm: str | None, platform: str, sampling: Sampling,
                     engine_args: str | Sequence[str] = "",
                     env: Mapping[str, str] | None = None) -> str | None:
    """Why generating ``sampling`` through ``algorithm`` on ``platform`` would not keep the
    target's distribution (naming the parameter or the platform), or None when it keeps it."""
    reasons = inexact(algorithm, platform, sampling, engine_args, env)
    if not reasons:
        return None
    return (f"{algorithm} would not keep the target's distribution: " + "; ".join(reasons)
            + ". Generate this run without speculative decoding (--mtp off or auto)"
            + (", or greedily (temperature 0)" if platform in ARGMAX_PLATFORMS else ""))

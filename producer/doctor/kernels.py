"""Which kernels a hybrid target's Gated DeltaNet layers run on in this environment.

transformers runs a Qwen3.5/3.6 linear-attention layer (the trainer's and the hidden worker's
forward of the target) on flash-linear-attention's kernels (``fla``: the gated delta rule) and
causal-conv1d's (the short convolution) when those packages import and the tensors sit on a
device they support (CUDA), else on its torch fallback: right, but many times slower and far
hungrier for memory at long sequences. The ``gpu`` extra installs flash-linear-attention
(a wheel); causal-conv1d ships only as source on PyPI (it compiles against the host's CUDA:
``pip install causal-conv1d --no-build-isolation``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from common.config import Settings
from common.engine.preflight import CheckResult
from producer.doctor.target import target_dir

NAME = "linear-attention kernels"


@dataclass(frozen=True)
class Kernel:
    """One package transformers uses for hybrid layers when it can."""

    module: str
    package: str
    covers: str
    install: str


KERNELS = (
    Kernel("fla", "flash-linear-attention", "gated delta rule",
           "pip install 'dflash-pipeline[gpu]' (or flash-linear-attention)"),
    Kernel("causal_conv1d", "causal-conv1d", "short convolution",
           "pip install causal-conv1d --no-build-isolation (compiles against CUDA)"),
)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_linear_attention_kernels(settings: Settings) -> list[CheckResult]:
    """For a hybrid target: each kernel package's verdict here, a WARN on the torch fallback."""
    from common.engine.target import TargetShape

    path, present = target_dir(settings)
    if not present or not (path / "config.json").is_file():
        return []
    if not TargetShape.from_dir(path).is_hybrid:
        return []
    import torch

    cuda = torch.cuda.is_available()
    rows = []
    for kernel in KERNELS:
        here = installed(kernel.module)
        if here and cuda:
            rows.append(CheckResult(NAME, ok=True, detail=f"{kernel.package}: the "
                                    f"{kernel.covers} of the hybrid layers runs on its kernels"))
            continue
        why = (f"{kernel.package} is not installed" if not here
               else "no CUDA device here (its kernels need one)")
        fix = kernel.install if not here else ("none needed on a CPU host; on GPU hosts run "
                                               "the trainer and hidden workers with CUDA")
        rows.append(CheckResult(NAME, ok=True, warn=True,
                                detail=f"{why}: the {kernel.covers} of the hybrid target's "
                                       "linear-attention layers runs on transformers' torch "
                                       "fallback (slow, memory-hungry on long sequences)",
                                fix=fix))
    return rows

"""Whether training fits a rank's GPU, and what to change where it does not.

    plan = TrainingPlan.make(target, drafter, Hardware(80, num_gpus=8, fsdp=True), tokens=32768)
    plan.fits, plan.max_tokens_that_fit, plan.budget, plan.advice, plan.verdict()
    plan.to_json()      # plan-training --json: per_rank_gib, fits, advice, epoch_hours, ...

A rank holds the resident part (the target, the drafter's state) for the whole run; a step adds a
micro-batch's features and the larger of the target's forward and the drafter's step
(:mod:`common.plan.memory`). ``tokens`` is the longest row (it goes through alone); the token
budget is the largest micro-batch of short rows that fits beside it. Activation checkpointing
``auto`` is on only where a step does not fit without it. A GPU's usable memory is what the device
reports (``torch.cuda.mem_get_info``'s total: an H100 80GB reports 79.2 GiB); the runtime's share
(CUDA context, NCCL, fragmentation) is a term of the step, and every verdict leaves a margin
(:data:`DEFAULT_MARGIN` of the usable memory): the budget, the checkpointing cut-over and
``fits`` all hold the planned peak at most ``usable - margin``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from common.choices import Checkpointing
from common.plan.compute import (
    DEFAULT_UTILIZATION,
    RowLength,
    epoch_flops,
    gpu_tflops,
    hours,
)
from common.plan.memory import Device, GiB, Micro, StepMemory, logits_chunk_for
from common.plan.shapes import DrafterDims, TargetDims

DEFAULT_MARGIN = 0.08      # of the usable memory, left free by every verdict
BUDGET_STEP = 256          # budgets are multiples of this many tokens
MAX_BUDGET = 65536         # past this a larger micro-batch no longer speeds a step up
MAX_TOKENS = 1 << 20       # the longest row the plan looks for


@dataclass(frozen=True)
class Hardware:
    """The ranks a run trains on: each one GPU of ``gpu_memory_gib``."""

    gpu_memory_gib: float
    num_gpus: int = 1
    fsdp: bool = False
    gpu_name: str | None = None
    cuda: bool = True
    margin: float = DEFAULT_MARGIN   # share of the usable memory no plan fills

    @property
    def usable(self) -> int:
        """The device's memory as it reports it (the runtime's share is a planned term)."""
        return int(self.gpu_memory_gib * GiB)

    @property
    def margin_bytes(self) -> int:
        return math.ceil(self.margin * self.usable)

    @property
    def limit(self) -> int:
        """The most a step is planned to hold: the usable memory less the margin."""
        return self.usable - self.margin_bytes

    @property
    def device(self) -> Device:
        return Device(cuda=self.cuda, ranks=self.num_gpus, fsdp=self.fsdp)


@dataclass(frozen=True)
class TrainingPlan:
    """The plan for one target, drafter and hardware, at a longest row of ``tokens``."""

    target: TargetDims
    drafter: DrafterDims
    hardware: Hardware
    tokens: int
    checkpointing_mode: Checkpointing = Checkpointing.AUTO
    max_anchors: int = 512
    rows: tuple[RowLength, ...] = ()
    utilization: float = DEFAULT_UTILIZATION
    tflops: float | None = None
    step: StepMemory = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpointing_mode", Checkpointing(self.checkpointing_mode))
        object.__setattr__(self, "step", self.row_memory(self.tokens))

    @classmethod
    def make(cls, target: TargetDims, drafter: DrafterDims, hardware: Hardware, tokens: int,
             **options: Any) -> TrainingPlan:
        return cls(target, drafter, hardware, tokens, **options)

    def memory(self, micro: Micro, checkpointing: bool) -> StepMemory:
        return StepMemory.of(self.target, self.drafter, micro, self.hardware.device,
                             checkpointing, logits_chunk_for(self.drafter.vocab_size))

    def _fitted(self, micro: Micro) -> StepMemory:
        """The micro-batch's memory with checkpointing as the mode says (auto: only if needed)."""
        if self.checkpointing_mode is not Checkpointing.AUTO:
            return self.memory(micro, self.checkpointing_mode is Checkpointing.ON)
        plain = self.memory(micro, False)
        return plain if plain.total <= self.hardware.limit else self.memory(micro, True)

    def row_memory(self, tokens: int) -> StepMemory:
        """One row of ``tokens`` alone (anchors on all but its first token)."""
        return self._fitted(Micro.row(tokens, self.drafter.block_size, self.max_anchors))

    def checkpointing_for(self, micro: Micro) -> bool:
        """Whether a micro-batch of this shape trains with activation checkpointing."""
        return self._fitted(micro).checkpointing

    def fits_micro(self, micro: Micro) -> bool:
        return self._fitted(micro).total <= self.hardware.limit

    @property
    def fits(self) -> bool:
        return self.step.total <= self.hardware.limit

    @property
    def resident_fits(self) -> bool:
        return self.step.resident <= self.hardware.limit

    @property
    def max_tokens_that_fit(self) -> int:
        """The longest row that fits alone (0: not even the resident part fits)."""
        return _largest(lambda t: self.row_memory(t).total <= self.hardware.limit, 1,
                        MAX_TOKENS)

    @property
    def budget(self) -> int:
        """Tokens a micro-batch of short rows may hold (padded target tokens and draft
        positions alike), a multiple of 256; 0 where none fits (rows then go one by one)."""
        steps = _largest(lambda n: self.fits_micro(Micro.budget(n * BUDGET_STEP,
                                                                  self.drafter.block_size)),
                         1, MAX_BUDGET // BUDGET_STEP)
        return steps * BUDGET_STEP

    @property
    def budget_memory(self) -> StepMemory | None:
        """The step at the budget's worst micro-batch (None: no budget fits)."""
        budget = self.budget
        if budget < 1:
            return None
        return self._fitted(Micro.budget(budget, self.drafter.block_size))

    @property
    def epoch_flops(self) -> float | None:
        if not self.rows:
            return None
        return self.rows_flops(self.rows)

    def rows_flops(self, rows: Sequence[RowLength], with_target: bool = True) -> float:
        """FLOPs of a pass over ``rows`` (``with_target``: their features computed, not read)."""
        return epoch_flops(self.target, self.drafter, rows, self.max_anchors,
                           self.step.checkpointing, with_target)

    @property
    def flops_per_s(self) -> float:
        """The rate the hours assume: the ranks' bf16 peak (or ``tflops``) at ``utilization``."""
        tflops = self.tflops or gpu_tflops(self.hardware.gpu_name)
        return self.hardware.num_gpus * tflops * 1e12 * self.utilization

    @property
    def epoch_hours(self) -> float | None:
        flops = self.epoch_flops
        if flops is None:
            return None
        tflops = self.tflops or gpu_tflops(self.hardware.gpu_name)
        return hours(flops, self.hardware.num_gpus, tflops, self.utilization)

    def advice(self) -> list[str]:
        """What to change where the longest row does not fit (empty where it does)."""
        return _advice(self) if not self.fits else []

    def verdict(self) -> str:
        """One line: fits or not, at what, and the fix."""
        hw, step = self.hardware, self.step
        layout = (f"FSDP over {hw.num_gpus}" if hw.fsdp else
                  f"a replica on each of {hw.num_gpus}" if hw.num_gpus > 1 else "one GPU")
        head = (f"{gib(step.total):.1f} of {gib(hw.limit):.1f} GiB per rank "
                f"({gib(hw.usable):.1f} less the {hw.margin:.0%} margin) at a "
                f"{self.tokens:,}-token row ({layout}, activation checkpointing "
                f"{'on' if step.checkpointing else 'off'})")
        if self.fits:
            return (f"fits: {head}; rows up to {self.max_tokens_that_fit:,} tokens fit, "
                    f"micro-batches of {self.budget:,} tokens")
        return f"does not fit: {head}; " + "; or ".join(self.advice())

    def to_json(self) -> dict[str, Any]:
        step, hw = self.step, self.hardware
        per_rank = {"target": step.target, "drafter_state": step.drafter_state,
                    "features": step.features, "target_transient": step.target_transient,
                    "drafter_activations": step.drafter_activations,
                    "collective_buffers": step.collective_buffers, "runtime": step.runtime,
                    "total": step.total}
        at_budget = self.budget_memory
        return {
            "per_rank_gib": {k: round(gib(v), 2) for k, v in per_rank.items()},
            "gpu_memory_gib": hw.gpu_memory_gib, "usable_gib": round(gib(hw.usable), 2),
            "margin_gib": round(gib(hw.margin_bytes), 2),
            "limit_gib": round(gib(hw.limit), 2),
            "mask_build_gib": round(gib(step.mask_build), 2),
            "budget_peak_gib": round(gib(at_budget.total), 2) if at_budget else None,
            "fits": self.fits, "max_tokens_that_fit": self.max_tokens_that_fit,
            "advice": self.advice(), "epoch_hours": _rounded(self.epoch_hours, 4),
            "epoch_flops": self.epoch_flops, "tokens": self.tokens,
            "num_gpus": hw.num_gpus, "fsdp": hw.fsdp, "checkpointing": step.checkpointing,
            "drafter_activations_gib": {
                "plain": round(gib(step.drafter_activations_plain), 2),
                "checkpointed": round(gib(step.drafter_activations_checkpointed), 2)},
            "budget_tokens": self.budget, "rows": len(self.rows),
            "target_params": self.target.params, "drafter_params": self.drafter.params,
            "gpu_tflops": self.tflops or gpu_tflops(hw.gpu_name),
            "utilization": self.utilization, "verdict": self.verdict(),
        }

    def with_hardware(self, **changes: Any) -> TrainingPlan:
        return replace(self, hardware=replace(self.hardware, **changes))


def gib(n: float) -> float:
    return n / GiB


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _largest(ok: Any, low: int, high: int) -> int:
    """The largest n in [low, high] with ok(n) (ok monotone: true, then false); low - 1: none."""
    if not ok(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low


def _advice(plan: TrainingPlan) -> list[str]:
    hw, fixes = plan.hardware, []
    if not hw.fsdp and hw.num_gpus > 1 and plan.with_hardware(fsdp=True).fits:
        fixes.append(f"--fsdp (shard the drafter and its optimizer state over the "
                     f"{hw.num_gpus} ranks)")
    ranks = next((n for n in (2, 4, 8, 16, 32, 64) if n > hw.num_gpus
                  and plan.with_hardware(num_gpus=n, fsdp=True).fits), None)
    if ranks and not (not hw.fsdp and hw.num_gpus > 1 and plan.with_hardware(fsdp=True).fits):
        fixes.append(f"more ranks: --fsdp over {ranks} GPUs")
    if plan.resident_fits:
        recomputed = replace(plan, checkpointing_mode=Checkpointing.ON)
        if plan.checkpointing_mode is Checkpointing.OFF and recomputed.fits:
            fixes.append("activation checkpointing on (--activation-checkpointing on)")
        longest = plan.max_tokens_that_fit
        if longest > 0:
            fixes.append(f"train on the first {longest:,} tokens of longer rows "
                         f"(enqueue --max-train-tokens {longest})")
    needed = plan.step.total / GiB / (1 - hw.margin)
    fixes.append(f"a larger GPU (at least {math.ceil(needed)} GiB)")
    return fixes


def plan_for(target: TargetDims, drafter: DrafterDims, hardware: Hardware,
             lengths: Sequence[RowLength], tokens: int | None = None,
             **options: Any) -> TrainingPlan:
    """The plan at the longest of ``lengths`` (or ``tokens``), with an epoch over them."""
    longest = tokens or max((r.tokens for r in lengths), default=0)
    if longest < 1:
        raise ValueError("no row length: give --tokens N or a run with committed samples")
    return TrainingPlan(target, drafter, hardware, longest, rows=tuple(lengths), **options)

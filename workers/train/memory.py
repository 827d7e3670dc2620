"""The memory plan on a training rank: its verdict when a run's session is built, the
micro-batch budget, activation checkpointing per micro-batch, and the rows no budget fits.

    plan = rank_plan(settings, config, target, drafter.config)   # None on the CPU
    check_resident(plan, run)            # PlanDoesNotFit (the shard parks) naming the fix,
                                         # where not even the shortest row fits beside them
    configure(trainer, plan, settings)   # batch_tokens, checkpointing per micro-batch
    plan.fits_row(tokens, supervised)    # a row that fits under no budget is set aside

On a GPU the plan is :class:`common.plan.verdict.TrainingPlan` for this rank's device (its total
memory, the group's ranks, FSDP or not); on the CPU there is no plan: the budget is
``CPU_BATCH_TOKENS`` and checkpointing is on only when asked.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from common.choices import Checkpointing, Parallel
from common.config import Settings
from common.errors import PlanDoesNotFit
from common.plan.memory import CUDA_CONTEXT, FRAGMENTATION, GiB, Micro, gathered_bytes
from common.plan.shapes import DrafterDims, TargetDims
from common.plan.verdict import Hardware, TrainingPlan
from common.runs.records import RunConfig
from workers.target_heads import target_device
from workers.train.drafter.microbatch import Drawn
from workers.train.process_group import current_group

log = logging.getLogger(__name__)

CPU_BATCH_TOKENS = 32768
REFERENCE_TOKENS = 32768   # the row the verdict is stated at, unless the run cuts its rows


def rank_plan(settings: Settings, config: RunConfig, target: Any,
              drafter_config: Any) -> TrainingPlan | None:
    """This rank's plan for the run (None on the CPU: no device memory to plan against)."""
    device = target_device(target)
    if device.type != "cuda":
        return None
    group = current_group()
    ranks = group.world if group else 1
    hardware = Hardware(reported_memory(device) / GiB, ranks,
                        settings.train.parallel is Parallel.FSDP and ranks > 1,
                        torch.cuda.get_device_properties(device).name,
                        margin=settings.train.memory_margin)
    tokens = getattr(config, "max_train_tokens", None) or REFERENCE_TOKENS
    return TrainingPlan(TargetDims.of_model(target), DrafterDims.from_config(drafter_config),
                        hardware, tokens,
                        checkpointing_mode=settings.train.activation_checkpointing,
                        max_anchors=settings.train.max_anchors)


def reported_memory(device: torch.device) -> int:
    """The memory this rank may plan with: what the device reports, less what other processes
    hold on it (the free memory with this process's own: its allocator's and its context's)."""
    free, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device) + CUDA_CONTEXT
    if free + ours < total:
        log.warning("GPU %s: %.1f GiB of %.1f GiB are held by other processes; planning with "
                    "the rest", device, (total - free - ours) / GiB, total / GiB)
    return min(total, free + ours)


def check_resident(plan: TrainingPlan | None, run: str) -> None:
    """Log the plan's verdict; raise when the target and the drafter state alone cannot fit."""
    if plan is None:
        log.info("run %s: on the CPU, no memory plan (micro-batches of %d tokens)", run,
                 CPU_BATCH_TOKENS)
        return
    log.info("run %s: memory plan: %s", run, plan.verdict())
    shortest = 2 * plan.drafter.block_size + 1   # the shortest row a step trains
    if plan.max_tokens_that_fit < shortest:
        fixes = "; or ".join(plan.advice())
        raise PlanDoesNotFit(f"run {run}: the target and the drafter's state need "
                             f"{plan.step.resident / GiB:.1f} GiB of this GPU's "
                             f"{plan.hardware.usable / GiB:.1f} GiB and leave no room for a "
                             f"step of {shortest} tokens; fix: {fixes}")


def micro_of(part: Sequence[Drawn], block_size: int) -> Micro:
    """A micro-batch's shape as the plan reads it."""
    widths = [d.tokens for d in part]
    queries = sum(d.draft_positions(block_size) for d in part)
    return Micro(len(part), max(widths), sum(widths), queries,
                 queries * (block_size - 1) // block_size)


def configure(trainer: Any, plan: TrainingPlan | None, settings: Settings) -> None:
    """The trainer's micro-batch budget and its activation checkpointing per micro-batch."""
    mode = settings.train.activation_checkpointing
    budget = settings.train.batch_tokens or (plan.budget if plan else CPU_BATCH_TOKENS)
    trainer.batch_tokens = max(1, budget)   # 0 from the plan: every row alone
    block = trainer.block_size
    if plan is None or mode is not Checkpointing.AUTO:
        trainer.checkpointing = lambda part: mode is Checkpointing.ON
    else:
        trainer.checkpointing = lambda part: plan.checkpointing_for(micro_of(part, block))
    if plan is not None:
        trainer.headroom = headroom_check(plan, block, trainer.device)


def headroom_check(plan: TrainingPlan, block_size: int, device: torch.device
                   ) -> Callable[[Sequence[Drawn], bool], None]:
    """Before an FSDP2 rank's forward (whose gathers a failing rank would leave waiting): an
    out-of-memory error raised now, inside the ranks' agreement, where the plan says the
    micro-batch's drafter step and gradient reduction need more than the device has free."""
    def check(part: Sequence[Drawn], recompute: bool) -> None:
        micro = micro_of(part, block_size)
        step = plan.memory(micro, recompute or plan.checkpointing_for(micro))
        # The drafter step, the gradient buffers and the layers FSDP2 gathers (back in the
        # allocator's cache now), with the allocator's fragmentation share.
        need = math.ceil((step.drafter_activations + step.collective_buffers
                          + gathered_bytes(plan.drafter, plan.hardware.device))
                         * (1 + FRAGMENTATION))
        free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
        if need > free:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (planned): the drafter step of {micro.tokens} tokens needs "
                f"{need / GiB:.2f} GiB, {free / GiB:.2f} GiB are free")
    return check


def fits_row(plan: TrainingPlan | None, tokens: int, supervised: int) -> bool:
    """Whether a row alone fits this rank (always, without a plan)."""
    if plan is None:
        return True
    micro = Micro.row(tokens, plan.drafter.block_size, plan.max_anchors, supervised)
    return plan.fits_micro(micro)

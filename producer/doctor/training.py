"""``doctor --run R``: whether the run's drafter training fits this host's GPUs (the memory plan,
:mod:`common.plan`, for the run's target, drafter and committed rows)."""

from __future__ import annotations

from common.choices import Parallel
from common.config import Settings
from common.engine.preflight import CheckResult, NoNvidiaDriver, gpu_model, visible_gpus
from common.errors import DflashError
from common.plan.verdict import Hardware


def check_training(settings: Settings, run: str) -> CheckResult:
    """The plan's verdict for ``run`` on this host: its first GPU, as many ranks as it sees,
    FSDP as ``DFLASH_TRAIN_PARALLEL`` says."""
    from producer.plan_training import run_plan

    name = "training memory"
    try:
        gpus = visible_gpus()
        gpu, memory = gpu_model(gpus[0]) if gpus else (None, None)
    except NoNvidiaDriver:
        gpus, gpu, memory = [], None, None
    if memory is None:
        return CheckResult(name, ok=True, warn=True,
                           detail=f"run {run}: no GPU here to plan training on",
                           fix=f"plan it for the GPUs it will run on: dflash-pipeline "
                               f"plan-training --run {run} --num-gpus N --gpu-memory-gib G")
    ranks = len(gpus)
    hardware = Hardware(memory, ranks, settings.train.parallel is Parallel.FSDP and ranks > 1, gpu,
                        margin=settings.train.memory_margin)
    try:
        plan = run_plan(settings, run, hardware)
    except (DflashError, ValueError) as exc:
        return CheckResult(name, ok=False, detail=f"run {run}: {exc}",
                           fix=f"check the run: dflash-pipeline status --run {run}")
    return CheckResult(name, ok=plan.fits, detail=f"run {run} on {ranks} x {gpu}: "
                       f"{plan.verdict()}",
                       fix="" if plan.fits else "; or ".join(plan.advice()))

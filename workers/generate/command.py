"""``dflash-pipeline worker generate``: a Celery worker on queue ``generate`` with its engine."""

from __future__ import annotations

from typing import Any

import click

from common.choices import EngineKind, EnumChoice, MtpMode
from common.cli import (
    FiniteRange,
    command_option,
    common_options,
    engine_launch_options,
    setting_option,
)
from common.config import Settings
from common.engine.models import resolve_model_path
from common.engine.mtp import choose_mtp, target_shape
from workers.launch import Launch, exec_worker
from workers.worker_cli import gpu_option, node_options

# One held shard leaves the engine part idle while its last requests drain; a second one keeps
# it full (simulator, 64 in flight: 0.81 of the cap with one shard, above 0.97 with two).
SGLANG_SHARDS = 2


def mtp_preflight(settings: Settings) -> None:
    """``--mtp on`` where MTP cannot run: one error line now (exit 2), not per shard."""
    if settings.generate.mtp is MtpMode.ON:
        choose_mtp(settings, target_shape(resolve_model_path(settings)))


# A generate worker owns its engine's GPUs: --gpu G and the --tp after it.
GENERATE = Launch("generate", app="workers.generate.app",
                  gpus=lambda settings: settings.generate.tp, preflight=mtp_preflight)


@click.command("generate")
@gpu_option("the CPU engine")
@command_option("concurrency", type=click.IntRange(min=1),
                help="Shards held at once (they share one engine) [default: 2 with --engine "
                     "sglang, so the next shard fills the engine while one drains; 1 with the "
                     "CPU engine].")
@setting_option("engine", type=EnumChoice(EngineKind), help="Generation engine.")
@setting_option("engine_url",
                help="Use this running SGLang-protocol server instead of starting one.")
@engine_launch_options
@setting_option("mtp", type=EnumChoice(MtpMode),
                help="Generate through the target's own MTP head (SGLang's NEXTN), decided per "
                     "run at its first task: auto follows the run's `bench --run` verdict for "
                     "this GPU model, TP and engine arguments at the concurrency nearest "
                     "--max-in-flight, else is on where the target states a head and SGLang "
                     "samples on a GPU; a run whose sampling the verify would change (min-p, "
                     "penalties; sampling on the CPU) runs without it. on: every run through "
                     "the head (such a run's shards park, naming the parameter); where it "
                     "cannot run at all it is an error. The log and `status` say which, and "
                     "why.")
@setting_option("engine_drain_timeout", type=FiniteRange(min=0),
                help="Seconds a stopping engine may finish its running requests before its "
                     "process tree is killed.")
@setting_option("max_in_flight", type=click.IntRange(min=1),
                help="Requests kept in flight per engine, shared by held shards.")
@node_options("generate")
@common_options
def worker_generate(settings: Settings, gpu: int | None, concurrency: int | None,
                    name: str | None, loglevel: str, **overrides: Any) -> None:
    """Run a Celery worker on queue `generate` with its engine (CPU model or SGLang server)."""
    if concurrency is None:
        engine = overrides.get("engine") or settings.generate.engine
        concurrency = SGLANG_SHARDS if engine is EngineKind.SGLANG else 1
    exec_worker(settings, GENERATE, gpu=gpu, concurrency=concurrency, name=name,
                loglevel=loglevel, overrides=overrides)

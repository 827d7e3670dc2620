"""``dflash-pipeline worker generate``: a Celery worker on queue ``generate`` with its engine."""

from __future__ import annotations

from typing import Any

import click

from common.choices import EngineKind, MtpMode
from common.cli import common_options, options_for
from common.config import Settings
from common.engine.models import resolve_model_path
from common.engine.mtp import choose_mtp, target_shape
from workers.launch import Launch, exec_worker

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
@options_for("worker generate")
@common_options
def worker_generate(settings: Settings, gpu: int | None, concurrency: int | None,
                    name: str | None, loglevel: str, **overrides: Any) -> None:
    """Run a Celery worker on queue `generate` with its engine (CPU model or SGLang server)."""
    if concurrency is None:
        engine = overrides.get("engine") or settings.generate.engine
        concurrency = SGLANG_SHARDS if engine is EngineKind.SGLANG else 1
    exec_worker(settings, GENERATE, gpu=gpu, concurrency=concurrency, name=name,
                loglevel=loglevel, overrides=overrides)

"""``dflash-pipeline worker generate|hidden|train``: one Celery worker process per queue and GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from common.config import Settings


def worker_group(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]
                 ) -> click.Group:
    """The ``worker`` group, its commands wrapped in the CLI's shared options."""

    @click.group()
    def worker() -> None:
        """Start a worker process for one queue."""


    @worker.command("generate")
    @click.option("--gpu", type=click.IntRange(min=0), default=None, envvar="DFLASH_GPU",
                  help="GPU index this worker owns (sets CUDA_VISIBLE_DEVICES).")
    @click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
                  envvar="DFLASH_CONCURRENCY", help="Shards held at once (they share one engine).")
    @click.option("--engine", type=click.Choice(["cpu", "sglang"]), default="cpu",
                  show_default=True, envvar="DFLASH_ENGINE", help="Generation engine.")
    @click.option("--engine-url", envvar="DFLASH_ENGINE_URL", default=None,
                  help="Use this running SGLang-protocol server instead of starting one.")
    @click.option("--engine-cmd", envvar="DFLASH_ENGINE_CMD", default=None,
                  help="Replace the engine launch command; {port}, {model}, {gpu}, {tp} are filled "
                       "in [default: python -m sglang.launch_server ...].")
    @click.option("--engine-args", envvar="DFLASH_ENGINE_ARGS", default=None,
                  help="Extra SGLang launch flags, e.g. speculative/MTP options.")
    @click.option("--tp", type=click.IntRange(min=1), default=None, envvar="DFLASH_TP",
                  help="Tensor-parallel size of the engine server [default: 1].")
    @click.option("--mem-fraction-static", envvar="DFLASH_MEM_FRACTION_STATIC", default=None,
                  help="SGLang --mem-fraction-static.")
    @click.option("--max-in-flight", type=click.IntRange(min=1), default=None,
                  envvar="DFLASH_MAX_IN_FLIGHT",
                  help="Requests kept in flight per engine, shared by held shards [default: 128].")
    @click.option("--name", default=None, envvar="DFLASH_WORKER_NAME",
                  help="Worker node name [default: generate-gpuN@host or generate-cpu@host].")
    @click.option("--loglevel", default="INFO", show_default=True, envvar="DFLASH_LOGLEVEL",
                  help="Celery log level.")
    @common_options
    def worker_generate(settings: Settings, gpu: int | None, concurrency: int, engine: str,
                        engine_url: str | None, engine_cmd: str | None, engine_args: str | None,
                        tp: int | None, mem_fraction_static: str | None, max_in_flight: int | None,
                        name: str | None, loglevel: str) -> None:
        """Run a Celery worker on queue `generate` with its engine (CPU model or SGLang server)."""
        from producer.commands import exec_worker

        engine_env = {
            "DFLASH_ENGINE": engine, "DFLASH_ENGINE_URL": engine_url or "",
            "DFLASH_ENGINE_CMD": engine_cmd or "", "DFLASH_ENGINE_ARGS": engine_args or "",
            "DFLASH_TP": str(tp or ""), "DFLASH_MEM_FRACTION_STATIC": mem_fraction_static or "",
            "DFLASH_MAX_IN_FLIGHT": str(max_in_flight or ""),
        }
        exec_worker(settings, queue="generate", gpu=gpu, concurrency=concurrency, name=name,
                    loglevel=loglevel, engine_env=engine_env)


    @worker.command("hidden")
    @click.option("--gpu", type=click.IntRange(min=0), default=None, envvar="DFLASH_GPU",
                  help="GPU index this worker owns (sets CUDA_VISIBLE_DEVICES) [default: CPU "
                       "unless one is visible].")
    @click.option("--batch-tokens", type=click.IntRange(min=1), default=None,
                  envvar="DFLASH_HIDDEN_BATCH_TOKENS",
                  help="Padded tokens per forward pass (rows are batched by length) "
                       "[default: 32768].")
    @click.option("--name", default=None, envvar="DFLASH_WORKER_NAME",
                  help="Worker node name [default: hidden-gpuN@host or hidden-cpu@host].")
    @click.option("--loglevel", default="INFO", show_default=True, envvar="DFLASH_LOGLEVEL",
                  help="Celery log level.")
    @common_options
    def worker_hidden(settings: Settings, gpu: int | None, batch_tokens: int | None,
                      name: str | None, loglevel: str) -> None:
        """Run a Celery worker on queue `hidden`: target hidden states of committed shards."""
        from producer.commands import exec_worker

        exec_worker(settings, queue="hidden", gpu=gpu, concurrency=1, name=name, loglevel=loglevel,
                    engine_env={"DFLASH_HIDDEN_BATCH_TOKENS": str(batch_tokens or "")})


    @worker.command("train")
    @click.option("--gpu", type=click.IntRange(min=0), default=None, envvar="DFLASH_GPU",
                  help="GPU index this worker owns (sets CUDA_VISIBLE_DEVICES) [default: CPU "
                       "unless one is visible].")
    @click.option("--rows-per-step", type=click.IntRange(min=1), default=None,
                  envvar="DFLASH_TRAIN_ROWS_PER_STEP", help="Training rows per optimizer step "
                  "[default: 8].")
    @click.option("--checkpoint-steps", type=click.IntRange(min=1), default=None,
                  envvar="DFLASH_TRAIN_CHECKPOINT_STEPS",
                  help="Checkpoint to storage every N steps [default: 50].")
    @click.option("--total-steps", type=click.IntRange(min=1), default=None,
                  envvar="DFLASH_TRAIN_TOTAL_STEPS",
                  help="Length of the cosine learning-rate schedule [default: 2000].")
    @click.option("--name", default=None, envvar="DFLASH_WORKER_NAME",
                  help="Worker node name [default: train-gpuN@host or train-cpu@host].")
    @click.option("--loglevel", default="INFO", show_default=True, envvar="DFLASH_LOGLEVEL",
                  help="Celery log level.")
    @common_options
    def worker_train(settings: Settings, gpu: int | None, rows_per_step: int | None,
                     checkpoint_steps: int | None, total_steps: int | None, name: str | None,
                     loglevel: str) -> None:
        """Run a Celery worker on queue `train`: online DFlash drafter training (one per run)."""
        from producer.commands import exec_worker

        exec_worker(settings, queue="train", gpu=gpu, concurrency=1, name=name, loglevel=loglevel,
                    engine_env={"DFLASH_TRAIN_ROWS_PER_STEP": str(rows_per_step or ""),
                                "DFLASH_TRAIN_CHECKPOINT_STEPS": str(checkpoint_steps or ""),
                                "DFLASH_TRAIN_TOTAL_STEPS": str(total_steps or "")})

    return worker

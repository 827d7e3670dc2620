"""``dflash-pipeline worker generate|hidden|train``: one Celery worker process per queue and GPU.

Options that are settings (``common.config.Settings``) take their default and ``DFLASH_*``
variable from there and reach the worker through its environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from common.cli import setting_option
from common.config import Settings, env_name

LOGLEVEL = "INFO"
# One held shard leaves the engine part idle while its last requests drain; a second one keeps
# it full (simulator, 64 in flight: 0.81 of the cap with one shard, above 0.97 with two).
SGLANG_SHARDS = 2


def gpu_option(queue: str) -> Callable[[Callable[..., Any]], Any]:
    unset = "the CPU engine" if queue == "generate" else "CPU unless a GPU is visible"
    return click.option("--gpu", type=click.IntRange(min=0), default=None,
                        envvar=env_name("gpu"),
                        help=f"GPU index this worker owns (sets CUDA_VISIBLE_DEVICES) "
                             f"[unset: {unset}].")


def node_options(queue: str) -> Callable[[Callable[..., Any]], Any]:
    """--name and --loglevel, the same for every worker kind."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        func = click.option("--loglevel", default=LOGLEVEL, show_default=True,
                            envvar="DFLASH_LOGLEVEL", help="Celery log level.")(func)
        return click.option("--name", default=None, envvar="DFLASH_WORKER_NAME",
                            help=f"Worker node name [default: {queue}-gpuN@host or "
                                 f"{queue}-cpu@host].")(func)

    return wrap


def worker_group(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]
                 ) -> click.Group:
    """The ``worker`` group, its commands wrapped in the CLI's shared options."""

    @click.group()
    def worker() -> None:
        """Start a worker process for one queue."""

    @worker.command("generate")
    @gpu_option("generate")
    @click.option("--concurrency", type=click.IntRange(min=1), default=None,
                  envvar="DFLASH_CONCURRENCY",
                  help="Shards held at once (they share one engine) [default: 2 with --engine "
                       "sglang, so the next shard fills the engine while one drains; 1 with the "
                       "CPU engine].")
    @setting_option("engine", type=click.Choice(["cpu", "sglang"]), help="Generation engine.")
    @setting_option("engine_url",
                    help="Use this running SGLang-protocol server instead of starting one.")
    @setting_option("engine_cmd", help="Replace the engine launch command; {port}, {model}, "
                                       "{gpu}, {tp} are filled in (empty: python -m "
                                       "sglang.launch_server ...).")
    @setting_option("engine_args", help="Extra SGLang launch flags, e.g. speculative/MTP options.")
    @setting_option("tp", type=click.IntRange(min=1),
                    help="Tensor-parallel size of the engine server.")
    @setting_option("mem_fraction_static", help="SGLang --mem-fraction-static.")
    @setting_option("max_in_flight", type=click.IntRange(min=1),
                    help="Requests kept in flight per engine, shared by held shards.")
    @node_options("generate")
    @common_options
    def worker_generate(settings: Settings, gpu: int | None, concurrency: int | None,
                        name: str | None, loglevel: str, **overrides: Any) -> None:
        """Run a Celery worker on queue `generate` with its engine (CPU model or SGLang server)."""
        from producer.commands import exec_worker

        if concurrency is None:
            engine = overrides.get("engine") or settings.engine
            concurrency = SGLANG_SHARDS if engine == "sglang" else 1

        exec_worker(settings, queue="generate", gpu=gpu, concurrency=concurrency, name=name,
                    loglevel=loglevel, overrides=overrides)

    def stage_worker(queue: str, doc: str, *options: Callable[[Any], Any]) -> None:
        """A one-shard-at-a-time worker of a downstream stage, with the stage's settings."""

        def command(settings: Settings, gpu: int | None, name: str | None, loglevel: str,
                    **overrides: Any) -> None:
            from producer.commands import exec_worker

            exec_worker(settings, queue=queue, gpu=gpu, concurrency=1, name=name,
                        loglevel=loglevel, overrides=overrides)

        command.__doc__ = doc
        wrapped = common_options(command)
        for option in (node_options(queue), *reversed(options), gpu_option(queue)):
            wrapped = option(wrapped)
        worker.command(queue)(wrapped)

    stage_worker(
        "hidden", "Run a Celery worker on queue `hidden`: target hidden states of committed "
                  "shards.",
        setting_option("hidden_batch_tokens", "--batch-tokens", type=click.IntRange(min=1),
                       help="Padded tokens per forward pass (rows are batched by length)."))
    stage_worker(
        "train", "Run a Celery worker on queue `train`: online DFlash drafter training (one per "
                 "run).",
        setting_option("train_rows_per_step", "--rows-per-step", type=click.IntRange(min=1),
                       help="Training rows per optimizer step."),
        setting_option("train_checkpoint_steps", "--checkpoint-steps", type=click.IntRange(min=1),
                       help="Checkpoint to storage every N steps."),
        setting_option("train_total_steps", "--total-steps", type=click.IntRange(min=1),
                       help="Length of the cosine learning-rate schedule."),
        setting_option("train_min_supervised_tokens", "--min-supervised-tokens",
                       type=click.IntRange(min=0),
                       help="Skip rows with fewer supervised tokens (0: 2 x block size)."),
        setting_option("train_eval_steps", "--eval-steps", type=click.IntRange(min=0),
                       help="Measure the acceptance length on held-out prompts every N steps "
                            "and at each checkpoint (0: never)."),
        setting_option("train_eval_prompts", "--eval-prompts", type=click.IntRange(min=1),
                       help="Held-out prompts each eval decodes."),
        setting_option("train_eval_max_new_tokens", "--eval-max-new-tokens",
                       type=click.IntRange(min=1), help="Token budget per eval prompt."),
        setting_option("train_nproc_per_node", "--nproc-per-node", type=click.IntRange(min=1),
                       help="Data-parallel ranks on this host, one per GPU (CUDA_VISIBLE_DEVICES "
                            "names them), started by torch.distributed.run."),
        setting_option("train_nnodes", "--nnodes", type=click.IntRange(min=1),
                       help="Hosts in the training group (each runs this command)."),
        setting_option("train_node_rank", "--node-rank", type=click.IntRange(min=0),
                       help="This host's rank in the group (0: the one with the queue consumer)."),
        setting_option("train_rdzv_endpoint", "--rdzv-endpoint",
                       help="HOST:PORT of node rank 0, where the hosts meet (several hosts)."),
        setting_option("train_parallel", "--fsdp", flag_value="fsdp",
                       help="Shard the drafter and its optimizer state over the ranks (FSDP2) "
                            "instead of a replica on each (DDP); needs --eval-steps 0."),
        setting_option("tensorboard_dir", "--tensorboard-dir",
                       help="Also write per-step training metrics to TensorBoard under "
                            "DIR/<run>/ (unset: off)."))

    return worker

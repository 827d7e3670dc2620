"""``dflash-pipeline worker train``: a Celery worker on queue ``train``, a group of ranks."""

from __future__ import annotations

import click

from common.choices import Checkpointing, EnumChoice
from common.cli import FiniteRange, setting_option
from workers.train.group import TRAIN_LAUNCH
from workers.worker_cli import stage_worker

worker_train = stage_worker(
    TRAIN_LAUNCH, "Run a Celery worker on queue `train`: online DFlash drafter training (one per "
             "run).",
    setting_option("train_rows_per_step", "--rows-per-step", type=click.IntRange(min=1),
                   help="Training rows per optimizer step."),
    setting_option("train_checkpoint_steps", "--checkpoint-steps", type=click.IntRange(min=1),
                   help="Checkpoint to storage every N steps."),
    setting_option("train_total_steps", "--total-steps", type=click.IntRange(min=0),
                   help="Override the length of the cosine learning-rate schedule (0: from the "
                        "run's data, epochs x training rows / rows per step). Training ends at "
                        "its last step, and says so if rows were left untrained."),
    setting_option("train_min_supervised_tokens", "--min-supervised-tokens",
                   type=click.IntRange(min=0),
                   help="Skip rows with fewer supervised tokens (0: 2 x block size)."),
    setting_option("train_max_anchors", "--max-anchors", type=click.IntRange(min=1),
                   help="Blocks drawn per row and step (a new drafter's; fewer: less time and "
                        "memory per step)."),
    setting_option("train_batch_tokens", "--batch-tokens", type=click.IntRange(min=0),
                   help="Padded target tokens and draft positions a micro-batch holds; a row "
                        "above it goes alone (0: the memory plan's budget for this GPU, 32768 "
                        "on the CPU)."),
    setting_option("train_activation_checkpointing", "--activation-checkpointing",
                   type=EnumChoice(Checkpointing),
                   help="Recompute the drafter's layers in the backward (auto: for the "
                        "micro-batches that would not fit without, by the memory plan)."),
    setting_option("train_memory_margin", "--memory-margin",
                   type=FiniteRange(0, 0.5, max_open=True),
                   help="Share of the GPU's reported memory the memory plan leaves free: the "
                        "micro-batch budget and the checkpointing cut-over stay below the rest."),
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
                        "instead of a replica on each (DDP)."),
    setting_option("tensorboard_dir", "--tensorboard-dir",
                   help="Also write per-step training metrics to TensorBoard under "
                        "DIR/<run>/ (unset: off)."))

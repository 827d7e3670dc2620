"""``dflash-pipeline plan-training``: whether drafter training fits the GPUs, before any is spent.

    dflash-pipeline plan-training --model benchmarks/shapes/qwen3.6-27b.json --tokens 32768 \\
        --num-gpus 8 --gpu-memory-gib 80 [--fsdp] [--json]
    dflash-pipeline plan-training --run my-run --num-gpus 8 --fsdp     # the run's own rows

From a target (a model directory, a config.json or a shape file: no weights are read), the
drafter's shape (the run's, ``--drafter-config``, or the target's own), the rows (``--run``: the
committed samples' lengths; ``--tokens N``: a row of N tokens, ``--rows`` of them an epoch) and
the hardware, it prints per rank the target's weights, the drafter's state, the captured
features at the longest row, the target forward's and the drafter step's transients, the total
against the GPU, whether it fits, the longest row that fits, the micro-batch token budget, what
to change where it does not fit, and an epoch's FLOPs and hours (:mod:`common.plan`). Exit 0
with a plan (fitting or not: ``fits`` says), 1 on an error, 2 on bad usage.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import click

from common import keys
from common.choices import Checkpointing, EnumChoice
from common.cli import FiniteRange, options_for
from common.config import Settings, load_settings
from common.declared import opt
from common.errors import DflashError
from common.exit_codes import EXIT_FAILURE
from common.plan.compute import DEFAULT_UTILIZATION, RowLength
from common.plan.shapes import DrafterDims, TargetDims
from common.plan.verdict import Hardware, TrainingPlan, gib, plan_for
from common.runs.records import RunConfig


def _target(settings: Settings, model: str) -> TargetDims:
    """A path (directory, config.json, shape file) as given; an embedded name, its directory."""
    from common.engine.models import resolve_model_path

    settings = settings.replace(model=model)
    if settings.model_is_tiny:
        click.echo("Preparing the embedded CPU model (built once, then cached)...", err=True)
    return TargetDims.load(resolve_model_path(settings) if settings.model_is_tiny else model)


def _drafter(target: TargetDims, drafter_config: str | None,
             run_config: RunConfig | None) -> DrafterDims:
    """The drafter a file, the run or the target gives (as a train worker would build it)."""
    from common.drafter.layers import resolve_target_layers
    from common.drafter.shape import check_target, read_shape

    if drafter_config:
        shape = read_shape(drafter_config)
        check_target(shape, target.shape)
        return DrafterDims.of(target.shape, shape, resolve_target_layers(None, target.shape))
    if run_config is not None and run_config.drafter is not None:
        return DrafterDims.of(target.shape, run_config.drafter.shape, run_config.target_layer_ids)
    return DrafterDims.of(target.shape, None, resolve_target_layers(None, target.shape))


def _run_lengths(settings: Settings, run: str) -> tuple[RunConfig, list[RowLength]]:
    """The run's config and its committed rows' lengths (cut at its --max-train-tokens)."""
    from common.runs.store import RunStore
    from common.storage import open_storage

    store = RunStore(open_storage(settings.broker.storage, settings.read), run)
    config = store.config()
    cap = getattr(config, "max_train_tokens", None)
    lengths = []
    for shard in sorted(store.committed()):
        for tokens, generated in store.row_lengths(shard):
            if cap and tokens > cap:
                generated, tokens = max(0, generated - (tokens - cap)), cap
            lengths.append(RowLength(tokens, generated))
    return config, lengths


def _hardware(num_gpus: int, gpu_memory_gib: float | None, fsdp: bool,
              margin: float) -> Hardware:
    """The hardware given, this host's first GPU filling in what is not."""
    from common.engine.preflight import NoNvidiaDriver, gpu_model

    name = None
    if gpu_memory_gib is None:
        try:
            name, gpu_memory_gib = gpu_model(0)
        except (NoNvidiaDriver, DflashError) as exc:
            raise click.UsageError(f"no GPU here to read ({exc}): give --gpu-memory-gib G") \
                from None
    return Hardware(gpu_memory_gib, num_gpus, fsdp, name, margin=margin)


def run_plan(settings: Settings, run: str, hardware: Hardware) -> TrainingPlan:
    """The plan of a run as its train workers would see it on ``hardware``."""
    config, lengths = _run_lengths(settings, run)
    target = _target(settings, config.model)
    return plan_for(target, _drafter(target, None, config), hardware, lengths,
                    checkpointing_mode=settings.train.activation_checkpointing,
                    max_anchors=settings.train.max_anchors)


def render(plan: TrainingPlan) -> str:
    """The plan as a table, one term a line, then the verdict and the fixes."""
    data = plan.to_json()
    per = data["per_rank_gib"]
    hw = plan.hardware
    lines = [f"target {plan.target.source}: {plan.target.params / 1e9:.2f} B parameters; "
             f"drafter {plan.drafter.num_hidden_layers} layers, {plan.drafter.params / 1e9:.3f} "
             f"B parameters, K={plan.drafter.num_features}",
             f"per rank at the longest row ({plan.tokens:,} tokens), {hw.num_gpus} GPU(s) of "
             f"{hw.gpu_memory_gib:g} GiB ({gib(hw.limit):.1f} planned, a {hw.margin:.0%} margin "
             f"of {gib(hw.margin_bytes):.1f} left free), "
             f"{'FSDP' if hw.fsdp else 'DDP' if hw.num_gpus > 1 else 'one rank'}:",
             f"  target weights         {per['target']:8.2f} GiB  (whole on every rank)",
             f"  drafter state          {per['drafter_state']:8.2f} GiB  (weights, gradients, "
             "AdamW moments)",
             f"  captured features      {per['features']:8.2f} GiB",
             f"  target forward peak    {per['target_transient']:8.2f} GiB",
             f"  drafter step           {per['drafter_activations']:8.2f} GiB  (checkpointing "
             f"{'on' if data['checkpointing'] else 'off'}; "
             f"{data['drafter_activations_gib']['plain']:.2f} without, "
             f"{data['drafter_activations_gib']['checkpointed']:.2f} with)",
             f"  collective buffers     {per['collective_buffers']:8.2f} GiB  (gradient "
             "reduction: FSDP2's unsharded gradients, reduce-scatter inputs)",
             f"  runtime                {per['runtime']:8.2f} GiB  (CUDA context, NCCL, "
             "allocator fragmentation)",
             f"  total                  {per['total']:8.2f} GiB  of {data['limit_gib']:.2f}",
             plan.verdict()]
    if data["epoch_hours"] is not None:
        lines.append(f"an epoch: {data['rows']:,} rows, {data['epoch_flops']:.3g} FLOPs, "
                     f"{data['epoch_hours']:,.2f} h on {hw.num_gpus} GPU(s) at "
                     f"{data['utilization']:.0%} of {data['gpu_tflops']:g} TFLOPS")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class PlanTrainingOptions:
    """``plan-training``'s own options."""

    model: str | None = opt(
        None, commands=("plan-training",),
        help="The target: a model directory, a config.json or a shape file (no weights "
             "are read) [default: the run's model].")
    drafter_config: str | None = opt(
        None, commands=("plan-training",), type=click.Path(exists=True, dir_okay=True),
        help="A DFlash drafter config.json to shape the drafter [default: the run's, "
             "else the target's own shape].")
    tokens: int | None = opt(
        None, commands=("plan-training",), type=click.IntRange(min=1),
        help="The longest row, in tokens [default: the run's longest].")
    rows: int | None = opt(
        None, commands=("plan-training",), type=click.IntRange(min=1),
        help="Rows of --tokens tokens in an epoch (for the hours, without --run).")
    num_gpus: int = opt(
        1, commands=("plan-training",), type=click.IntRange(min=1),
        help="Training ranks, one GPU each.")
    gpu_memory_gib: float | None = opt(
        None, commands=("plan-training",), type=FiniteRange(min=1),
        help="Memory of each GPU in GiB, as the device reports it (an H100 80GB: 79.2) "
             "[default: this host's first GPU].")
    fsdp: bool = opt(
        False, commands=("plan-training",), is_flag=True,
        help="Shard the drafter and its optimizer state (FSDP2).")
    activation_checkpointing: str = opt(
        "auto", commands=("plan-training",), type=EnumChoice(Checkpointing),
        help="Recompute the drafter's layers in the backward (auto: "
             "where a step does not fit without).")
    max_anchors: int | None = opt(
        None, commands=("plan-training",), type=click.IntRange(min=1),
        help="Blocks drawn per row [default: the train worker's setting].")
    utilization: float = opt(
        DEFAULT_UTILIZATION, commands=("plan-training",), type=FiniteRange(0, 1, min_open=True),
        help="Share of the GPU's bf16 peak an epoch's hours assume.")
    gpu_tflops: float | None = opt(
        None, commands=("plan-training",), type=FiniteRange(min=0, min_open=True),
        help="The GPU's dense bf16 peak [default: by its name, else an H100's 989].")


@click.command("plan-training")
@options_for("plan-training", PlanTrainingOptions)
def plan_training(model: str | None, drafter_config: str | None, run: str | None,
                  tokens: int | None, rows: int | None, num_gpus: int,
                  gpu_memory_gib: float | None, fsdp: bool, activation_checkpointing: str,
                  max_anchors: int | None, train_memory_margin: float | None, utilization: float,
                  gpu_tflops: float | None,
                  storage: str | None, as_json: bool) -> None:
    """Plan training memory per rank and an epoch's hours; say whether it fits and the fix."""
    if run is None and (model is None or tokens is None):
        raise click.UsageError("give --run RUN, or --model and --tokens")
    if run is not None and not keys.valid_run_id(run):
        raise click.BadParameter(f"invalid run id {run!r}", param_hint="--run")
    try:
        settings = load_settings(storage=storage)
        hardware = _hardware(num_gpus, gpu_memory_gib, fsdp,
                             settings.train.memory_margin if train_memory_margin is None
                             else train_memory_margin)
        config, lengths = _run_lengths(settings, run) if run else (None, [])
        target = _target(settings, model or (config.model if config else ""))
        drafter = _drafter(target, drafter_config, config)
        if tokens and rows:
            lengths = [RowLength(tokens, tokens)] * rows
        plan = plan_for(target, drafter, hardware, lengths, tokens,
                        checkpointing_mode=activation_checkpointing,
                        max_anchors=max_anchors or settings.train.max_anchors,
                        utilization=utilization, tflops=gpu_tflops)
    except (DflashError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    click.echo(json.dumps(plan.to_json(), sort_keys=True) if as_json else render(plan))

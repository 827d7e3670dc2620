"""The train stage's commands, registered by name into the ``dflash-pipeline`` group.

``dflash-pipeline export-drafter --run RUN --out DIR [--step N] [--dtype D] [--json]``;
``dflash-pipeline eval-drafter --run RUN [--step N | --drafter DIR] [--prompts PATH] [--num 64]
[--max-new-tokens 512] [--block-size B] [--json]`` (:mod:`workers.train.eval_command`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import click

from common.choices import EnumChoice, WeightsDtype
from common.cli import common_options, options_for
from common.config import Settings
from common.declared import opt
from common.errors import NotFound


@dataclass(frozen=True, kw_only=True)
class ExportDrafterOptions:
    """``export-drafter``'s own options."""

    out_dir: str = opt(
        required=True,
        decls=("--out",),
        commands=("export-drafter",),
        type=click.Path(file_okay=False),
        help="Directory to write config.json and model.safetensors to.")
    step: int | None = opt(
        None, commands=("export-drafter",), type=click.IntRange(min=1),
        help="Checkpoint step to export [default: the best-evaluated one (highest "
             "held-out tau measured while training), else the newest].")
    dtype: WeightsDtype = opt(
        WeightsDtype.AUTO,
        commands=("export-drafter",),
        type=EnumChoice(WeightsDtype),
        help="Weights' dtype; auto: the target's (config.json), else the checkpoint's.")


@click.command("export-drafter")
@options_for("export-drafter", ExportDrafterOptions)
@common_options
def export_drafter(settings: Settings, run: str, out_dir: str, step: int | None,
                   dtype: WeightsDtype, as_json: bool) -> None:
    """Export a run's drafter checkpoint as an HF-style directory SGLang's DFLASH loads."""
    result = export_drafter_checkpoint(settings, run, out_dir, step, dtype)
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    else:
        why = {"best-tau": f" (best held-out tau {result['tau']})",
               "newest": " (newest; no tau measured)"}.get(result["chosen"], "")
        click.echo(f"run {run}: drafter step {result['step']}{why} exported to {result['out']} "
                   f"({result['tensors']} tensors, {result['dtype']}); serve it with:\n"
                   f"  {result['serve_command']}")
        if result["drafter_shape"]:
            click.echo(f"drafter shape from {result['drafter_shape']['source']} (frozen in "
                       "run.json at enqueue)")


def choose_step(settings: Settings, run: str,
                step: int | None) -> tuple[int | None, str, float | None]:
    """The step to export: ``step`` as asked, else the best-evaluated, else the newest; with
    how it was chosen and its measured tau (None when unmeasured)."""
    from common.runs.checkpoints import best_step
    from common.storage import open_storage

    if step is not None:
        return step, "asked", None
    best = best_step(open_storage(settings.broker.storage, settings.read), run)
    return (best[0], "best-tau", best[1]) if best else (None, "newest", None)


def check_checkpoint(storage: Any, run: str, step: int | None) -> None:
    """``NotFound`` unless the run has a checkpoint (at ``step``); cheap: no torch, no model."""
    from common.runs.checkpoints import committed_steps

    steps = committed_steps(storage, run)
    if not steps:
        raise NotFound(f"run {run!r} has no drafter checkpoint yet (runs/{run}/drafter/); "
                       "train with `dflash-pipeline worker train` on an online run")
    if step is not None and step not in steps:
        raise NotFound(f"run {run!r} has no checkpoint at step {step}; steps: {steps}")


def load_run_drafter(settings: Settings, run: str, step: int | None,
                     device: Any = None, newest_else: bool = False) -> RunDrafter:
    """A run's target (mask token added) and its drafter checkpoint at ``step`` or the newest
    (``newest_else``: the newest that loads where the one at ``step`` does not)."""
    from common.runs.store import RunStore
    from common.storage import open_storage
    from workers.train.drafter.train import DrafterTrainer

    storage = open_storage(settings.broker.storage, settings.read)
    config = RunStore(storage, run).config()
    state = checkpoint_state(storage, run, step, newest_else)
    target = load_run_target(settings, config, device)
    trainer = DrafterTrainer.from_state_dict(state, target.model)
    return RunDrafter(target, trainer, trainer.steps, config)


def checkpoint_state(storage: Any, run: str, step: int | None,
                     newest_else: bool = False) -> dict[str, Any]:
    """The trainer state of the newest checkpoint (at ``step``) whose state loads; with
    ``newest_else``, the newest of any step where none at ``step`` does. ``NotFound`` where
    none loads: committed keys whose commit or state is foreign are no checkpoint."""
    from common.runs.checkpoints import load_checkpoint

    check_checkpoint(storage, run, step)
    loaded = load_checkpoint(storage, run, step)
    if loaded is None and step is not None and newest_else:
        loaded = load_checkpoint(storage, run)
    if loaded is None:
        at = "" if step is None else f" at step {step}"
        raise NotFound(f"run {run!r} has no drafter checkpoint{at} that loads (its commits "
                       "or states are foreign or unreadable; the log names each one)")
    return loaded[0]


@dataclass
class RunTarget:
    """A run's target model with the DFlash mask token, its tokenizer and where it lives."""

    model: Any
    tokenizer: Any
    path: str


@dataclass
class RunDrafter:
    target: RunTarget
    trainer: Any
    step: int
    config: Any = None   # the run's RunConfig


def load_run_target(settings: Settings, config: Any, device: Any = None) -> RunTarget:
    """The run's target on ``device`` (bf16 on a GPU, float32 elsewhere) with its mask token."""
    from common.engine.models import resolve_model_path
    from workers.train.drafter.model import add_mask_token
    from workers.train.drafter.target_loader import load_target

    path = resolve_model_path(settings.replace(model=config.model))
    model, tokenizer = load_target(path, device)
    add_mask_token(tokenizer, model)
    return RunTarget(model, tokenizer, str(path))


def export_drafter_checkpoint(settings: Settings, run: str, out_dir: str, step: int | None,
                              dtype: WeightsDtype = WeightsDtype.AUTO) -> dict[str, Any]:
    """Load a drafter checkpoint on the run's target and write the HF-style export."""
    from common.drafter.origin import drafter_summary
    from common.engine.serving import dflash_engine_args, launch_argv, shell_line
    from workers.train.drafter.export import DTYPES, export_drafter, target_dtype

    step, chosen_by, tau = choose_step(settings, run, step)
    loaded = load_run_drafter(settings, run, step, newest_else=chosen_by == "best-tau")
    if loaded.step != step and step is not None:   # the best-evaluated one did not load
        chosen_by, tau = "newest", None
    chosen = (target_dtype(loaded.target.path) if dtype is WeightsDtype.AUTO
              else DTYPES[dtype.value])
    out = export_drafter(loaded.trainer, out_dir, dtype=chosen)
    stored = json.loads((out / "config.json").read_text())["dtype"]
    # The serving line for this target, running the generate worker's concurrency (SGLang sizes
    # a hybrid's mamba state cache itself).
    generate = settings.generate
    engine_args = dflash_engine_args(out.resolve(), block_size=loaded.trainer.drafter.config
                                     .block_size, max_running_requests=generate.max_in_flight)
    serve = launch_argv(loaded.target.path, port=generate.engine_port, tp=generate.tp,
                        engine_args=engine_args, python="python")
    return {"run": run, "step": loaded.step, "chosen": chosen_by, "tau": tau,
            "out": str(out), "dtype": stored,
            "tensors": len(loaded.trainer.drafter.state_dict()),
            "serve_engine_args": shell_line(engine_args), "serve_command": shell_line(serve),
            "drafter_shape": drafter_summary(loaded.config.drafter,
                                             loaded.config.target_layer_ids)}

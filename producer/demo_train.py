"""The demo's training half: the train worker's settings, the live view, the final eval, exports.

The drafter trains on each shard as soon as it is committed (an online run), then for
``demo --epochs`` epochs in all (3 by default), its schedule made from the data (no step count
is set here); its settings are sized for the demo's ~160 rows on two CPU cores: short steps, a
checkpoint (and a measured acceptance length on held-out prompts) every few steps and at the
end of every epoch. At the
end ``eval-drafter`` decodes every held-out prompt speculatively and plainly (tau, and whether
both outputs are equal token for token), then ``export-dataset`` and ``export-drafter`` write
what a user takes away. Every step runs the product's own commands, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import click

from common.choices import RunState
from common.config import env_name
from common.errors import ConfigError
from common.exit_codes import EXIT_FAILURE, EXIT_OK
from producer.children import die_with_parent
from producer.status import StatusReader
from producer.status_record import Downstream, RunStatus

REFRESH_S = 1.0


@dataclass(frozen=True)
class TrainPlan:
    """The demo trainer's settings (``worker train``'s, by their ``DFLASH_TRAIN_*`` names)."""

    rows_per_step: int = 4
    checkpoint_steps: int = 16
    eval_steps: int = 16
    eval_prompts: int = 4
    eval_max_new_tokens: int = 64

    def worker_env(self, env: dict[str, str]) -> dict[str, str]:
        """The train worker's environment: these settings unless a ``DFLASH_TRAIN_*`` variable
        says otherwise, and one torch thread (generation and training share the cores)."""
        plan = {env_name(f"train_{f.name}"): str(getattr(self, f.name)) for f in fields(self)}
        return {**plan, **THREAD_ENV, **env}


TRAIN = TrainPlan()
# Generation and training share the cores: one torch thread each, so neither starves the other.
THREAD_ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Watched:
    """The last status, and when generation finished (seconds after the enqueue began)."""

    status: RunStatus
    generated_s: float


def watch_demo(reader: StatusReader, online: bool, check: Callable[[], None],
               started: float) -> Watched:
    """Live bars for generation and (online) training until both finish or the run stops;
    ``started`` is the enqueue's ``time.monotonic()``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from producer.commands import _known

    columns = (TextColumn("[bold]{task.description:>8}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"))
    generated = None
    with Progress(*columns, transient=False) as progress:
        gen = progress.add_task("generate", total=None, detail="")
        train = progress.add_task("train", total=None, detail="", visible=online)
        while True:
            status = reader.read()
            samples, shards = status["samples"], status["shards"]
            progress.update(
                gen, total=samples["total"], completed=samples["done"] + samples["in_progress"],
                detail=f"{status['state']} | shards {shards['committed']}/{shards['total']} | "
                       f"{_known(status['tokens']['per_s'], '.0f')} tok/s")
            state = status["state"]
            if generated is None and state == RunState.DONE:
                generated = time.monotonic() - started
            down = status["downstream"]
            if online:
                train_state = down.get("train") or {}
                progress.update(train, total=train_state.get("total_steps"),
                                completed=train_state.get("step") or 0,
                                detail=train_detail(down))
            if state in (RunState.FAILED, RunState.PAUSED) or (
                    state == RunState.DONE and (not online or trained(down))):
                return Watched(status, generated or time.monotonic() - started)
            check()
            time.sleep(REFRESH_S)


def trained(down: Downstream) -> bool:
    """The trainer finished (every epoch, or why not); a parked train shard ends the wait too."""
    if down.get("parked"):
        raise ConfigError(f"the trainer parked {down['parked']} shard(s); see `dflash-pipeline "
                          "status` and the trainer log")
    return bool(down.get("finished"))


def train_detail(down: Downstream) -> str:
    train = down.get("train") or {}
    if train.get("step") is None:
        return "waiting for the first committed shard"
    tau = f" | tau {down['tau']:.3f} at step {down['tau_step']}" if down.get("tau") else ""
    # A checkpoint's eval can record tau before the first optimizer step records a loss.
    loss = f" | loss {float(train['loss']):.3f}" if train.get("loss") not in (None, "") else ""
    lr = f" | lr {train['lr']:.2e}" if train.get("lr") is not None else ""
    return f"epoch {train['epoch']}/{train['epochs']}{loss}{lr}{tau}"


def tau_by_epoch_line(down: Downstream) -> str:
    """The held-out tau measured at each epoch's end, as the demo prints it."""
    train = down.get("train") or {}
    taus = ", ".join("-" if t is None else f"{t:.3f}" for t in train.get("tau_by_epoch") or [])
    return (f"drafter trained {train.get('epoch')} epoch(s), {train.get('step')} steps "
            f"(schedule {train.get('total_steps')}, finished: {down.get('finished')}); "
            f"held-out tau by epoch: {taus or 'not measured'}")


def finish_training(exe: list[str], env: dict[str, str], out_dir: Path, run: str, prompts: int,
                    max_new_tokens: int) -> int:
    """Export the drafter (its best-evaluated step), measure that very step on the held-out
    split, export the dataset; 0 when decoding was lossless and both exports were written."""
    drafter = _command(exe, env, "export-drafter", "--run", run, "--out",
                       str(out_dir / "export" / "drafter"), "--json")
    click.echo(f"measuring drafter step {drafter['step']}, the one exported "
               f"({chosen_line(drafter)}), on up to {prompts} held-out prompts (speculative "
               f"and plain greedy decoding, {max_new_tokens} tokens each)...")
    result = _command(exe, env, "eval-drafter", "--run", run, "--step", str(drafter["step"]),
                      "--num", str(prompts), "--max-new-tokens", str(max_new_tokens), "--json")
    lossless = result["lossless"]
    exact = lossless["checked"] - len(lossless["mismatches"])
    click.echo(f"acceptance length tau {result['tau']:.3f} (pooled {result['tau_pooled']:.3f}) "
               f"with drafter step {result['step']} on {result['prompts']} held-out prompts, "
               f"{result['tokens']} tokens; lossless {exact}/{lossless['checked']} (speculative "
               "output equal to greedy token for token)")
    dataset = _command(exe, env, "export-dataset", "--run", run, "--out",
                       str(out_dir / "export" / "dataset"), "--format", "parquet",
                       "--split-heldout", "--json")
    splits = ", ".join(f"{s} {n}" for s, n in dataset["samples"].items())
    click.echo(f"dataset: {out_dir / 'export' / 'dataset'}  (Parquet, {splits} samples; "
               "datasets.load_dataset('parquet', data_dir=...))")
    click.echo(f"drafter: {drafter['out']}  (step {drafter['step']}, {drafter['dtype']}; "
               "SGLang --speculative-algorithm DFLASH --speculative-draft-model-path ...)")
    return EXIT_OK if exact == lossless["checked"] else EXIT_FAILURE


def chosen_line(exported: dict[str, Any]) -> str:
    """Why export-drafter took its step: the best held-out tau measured while training, or the
    newest when none was measured."""
    if exported.get("chosen") == "best-tau":
        return f"best-evaluated: held-out tau {exported['tau']:.3f} during training"
    return "the newest; no held-out tau was measured during training"


def _command(exe: list[str], env: dict[str, str], *args: str) -> dict[str, Any]:
    """Run one of the product's commands with ``--json``; its object, or one clear error."""
    done = subprocess.run([*exe, *args], env=env, capture_output=True, text=True,
                          preexec_fn=die_with_parent)
    try:
        answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return answer
    except (IndexError, json.JSONDecodeError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"`dflash-pipeline {args[0]}` failed (exit {done.returncode}): "
                          f"{last}") from None

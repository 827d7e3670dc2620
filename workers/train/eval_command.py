"""``dflash-pipeline eval-drafter``: a drafter's real acceptance length, by speculative decoding.

    dflash-pipeline eval-drafter --run RUN                     # newest checkpoint, held-out split
    dflash-pipeline eval-drafter --run RUN --step 400 --num 32 --max-new-tokens 256 --json
    dflash-pipeline eval-drafter --run RUN --drafter out/drafter --prompts more.jsonl
    dflash-pipeline eval-drafter --run RUN --drafter DIR --dataset gsm8k=test.jsonl \
        --dataset mt-bench=question.jsonl --no-thinking --json      # the standard sets' table
    dflash-pipeline eval-drafter --run RUN --dataset humaneval=HumanEval.jsonl --engine sglang \
        --url http://gpu:30000 --baseline-url http://gpu:30001 --concurrency 1,8,32

Exit 0 when every prompt decodes to exactly the target's greedy output; 1 when the run has no
checkpoint, the drafter does not fit the target, there are no prompts, or a prompt decodes
differently (a bug: the prompt is named). Any other failure is one ``error:`` line too, exit 1
(the traceback goes to the log with ``-v``), never a raw traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

import click

from common.choices import EnumChoice, EvalEngine
from common.cli import common_options, options_for
from common.config import Settings, env_name
from common.declared import opt
from common.errors import ConfigError, DflashError, StorageError, StorageRefused
from common.exit_codes import EXIT_FAILURE
from workers.train.eval_datasets import DatasetRequest
from workers.train.eval_serving import parse_levels
from workers.train.eval_sets import parse_datasets
from workers.train.eval_table import render_table

log = logging.getLogger(__name__)

SET_NUM = 128   # prompts per --dataset set unless --num says


@dataclass(frozen=True, kw_only=True)
class EvalDrafterOptions:
    """``eval-drafter``'s own options."""

    step: int | None = opt(
        None, commands=("eval-drafter",), type=click.IntRange(min=1),
        help="Checkpoint step [default: the newest].")
    drafter_dir: str | None = opt(
        None, decls=("--drafter",), commands=("eval-drafter",), type=click.Path(file_okay=False),
        help="An exported drafter directory instead of a checkpoint.")
    prompts_path: str | None = opt(
        None, decls=("--prompts",), commands=("eval-drafter",),
        help="Prompts from any input enqueue reads [default: the run's held-out split].")
    num: int | None = opt(
        None, commands=("eval-drafter",), type=click.IntRange(min=1),
        help="Prompts to decode (per set with --dataset) [default: 64; 128 with "
             "--dataset].")
    max_new_tokens: int = opt(
        512, commands=("eval-drafter",), type=click.IntRange(min=1),
        help="Token budget per prompt.")
    block_size: int | None = opt(
        None, commands=("eval-drafter",), type=click.IntRange(min=2),
        help="Tokens per verify step [default: the drafter's block size].")
    datasets: tuple[str, ...] = opt(
        None, decls=("--dataset",), commands=("eval-drafter",), multiple=True,
        help="A standard set (repeatable): NAME=PATH (gsm8k, math500, humaneval, mbpp, "
             "mt-bench: a local copy in its published layout), NAME (fetched from the "
             "Hugging Face hub) or PATH (any prompt file, named by its stem).")
    thinking: bool | None = opt(
        None, decls=("--thinking/--no-thinking",), commands=("eval-drafter",),
        help="Render --dataset prompts with thinking on or off [default: the run's].")
    engine: EvalEngine = opt(
        EvalEngine.LOCAL,
        decls=("--engine",),
        commands=("eval-drafter",),
        type=EnumChoice(EvalEngine),
        help="local: our lossless loop; sglang: a running SGLang at --url (--dataset).")
    url: str | None = opt(
        None, commands=("eval-drafter",),
        help="The SGLang serving the drafter (--engine sglang).")
    baseline_url: str | None = opt(
        None, commands=("eval-drafter",),
        help="The same target served without speculation: tokens/s and speedup.")
    concurrency: str = opt(
        "1", commands=("eval-drafter",),
        help="Requests in flight with --engine sglang, e.g. 1,8,32.")


@click.command("eval-drafter")
@options_for("eval-drafter", EvalDrafterOptions)
@common_options
def eval_drafter(settings: Settings, run: str, step: int | None, drafter_dir: str | None,
                 prompts_path: str | None, num: int | None, max_new_tokens: int,
                 block_size: int | None, as_json: bool, datasets: tuple[str, ...],
                 thinking: bool | None, engine: EvalEngine, url: str | None,
                 baseline_url: str | None, concurrency: str) -> None:
    """Decode prompts with the drafter and the run's target: acceptance length, losslessness."""
    if step is not None and drafter_dir is not None:
        raise click.UsageError("--step and --drafter are exclusive")
    if datasets and prompts_path is not None:
        raise click.UsageError("--prompts and --dataset are exclusive (--dataset PATH reads "
                               "a prompt file)")
    if not datasets and (engine != EvalEngine.LOCAL or thinking is not None):
        raise click.UsageError("--engine and --thinking need --dataset")
    if engine == EvalEngine.SGLANG and not url:
        raise click.UsageError("--engine sglang needs --url (the server of the drafter)")
    try:
        if datasets:
            result = _run_datasets(settings, run, step, drafter_dir, DatasetRequest(
                parse_datasets(datasets), num or SET_NUM, thinking, max_new_tokens,
                block_size, engine, url, baseline_url, parse_levels(concurrency)))
        else:
            result = run_eval(settings, run, step, drafter_dir, prompts_path, num or 64,
                              max_new_tokens, block_size)
    except (DflashError, click.ClickException, OSError):
        raise        # the shared handlers' one-line messages
    except Exception as exc:
        log.info("eval-drafter failed", exc_info=True)
        first = str(exc).splitlines()[0] if str(exc) else ""
        click.echo(f"error: evaluating the drafter of run {run!r} failed: "
                   f"{type(exc).__name__}: {first}", err=True)
        sys.exit(EXIT_FAILURE)
    if datasets:
        result["stored"] = _store(settings, run, result, step, drafter_dir)
    text = render_table(result) if datasets else render(result)
    click.echo(json.dumps(result, sort_keys=True) if as_json else text)
    mismatches = ([m for r in result["datasets"].values() for m in (r["lossless"] or {}).get(
        "mismatches", [])] if datasets else result["lossless"]["mismatches"])
    if mismatches:
        first = mismatches[0]
        click.echo(f"error: speculative decoding differs from greedy decoding on "
                   f"{len(mismatches)} prompt(s); first: prompt {first['prompt']!r} at token "
                   f"{first['position']} (greedy {first['greedy']}, speculative "
                   f"{first['speculative']}); this is a bug, please report it", err=True)
        sys.exit(EXIT_FAILURE)


def run_eval(settings: Settings, run: str, step: int | None, drafter_dir: str | None,
             prompts_path: str | None, num: int, max_new_tokens: int,
             block_size: int | None) -> dict[str, Any]:
    """Load, pick prompts, decode; the ``--json`` object."""
    store, config = _open(settings, run, step, drafter_dir)
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from workers.train.drafter.specdec import DFlashProposer
    from workers.train.evaluation import evaluate, stop_ids

    target, drafter, source_step, device = _load(settings, run, config, step, drafter_dir)
    prompts, source = _prompts(store, config, target.tokenizer, prompts_path, num)
    with torch.inference_mode(), Progress(transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"decoding {len(prompts)} prompts", total=len(prompts))
        report = evaluate(target.model, DFlashProposer(drafter, block_size), prompts,
                          drafter.config.target_layer_ids, max_new_tokens,
                          stop_ids(target.model, target.tokenizer), check=True,
                          progress=lambda done, _: bar.update(task, completed=done))
    return {"run": run, "step": source_step, "drafter": drafter_dir, "source": source,
            "max_new_tokens": max_new_tokens, "device": str(device), **report.to_json()}


def _run_datasets(settings: Settings, run: str, step: int | None, drafter_dir: str | None,
                  request: DatasetRequest) -> dict[str, Any]:
    """``--dataset``: the per-set table (:mod:`workers.train.eval_datasets`)."""
    from workers.train.eval_datasets import run_sets

    local = request.engine == EvalEngine.LOCAL
    _, config = _open(settings, run, step, drafter_dir, check=local)
    result = run_sets(settings, config, request,
                      lambda: _load(settings, run, config, step, drafter_dir))
    return {"drafter": drafter_dir, **result}


def _store(settings: Settings, run: str, result: dict[str, Any], step: int | None,
           drafter_dir: str | None) -> str | None:
    """The table stored under the run (its key), or None with one line where the storage
    refuses the write: only the train worker's key may write ``evals/``."""
    from common.runs.evals import write_eval
    from common.storage import open_storage

    storage = open_storage(settings.broker.storage, settings.read)
    measured = result.get("step", step) if drafter_dir is None else None
    try:
        return write_eval(storage, run, result, measured, drafter_dir)
    except StorageRefused as exc:
        log.debug("run %s: eval not stored: %s", run, exc)
        click.echo(f"eval not stored in the run's storage ({str(exc).split(': ', 1)[-1]}): "
                   "run eval-drafter with the train worker's key to keep it for report and "
                   "the dashboard", err=True)
    except (StorageError, ValueError) as exc:   # the table is printed all the same
        log.warning("run %s: eval not stored: %s: %s", run, type(exc).__name__, exc)
    return None


def _open(settings: Settings, run: str, step: int | None, drafter_dir: str | None,
          check: bool = True) -> tuple[Any, Any]:
    """The run's store and config; the drafter to judge checked (before torch is imported)."""
    from common.runs.store import RunStore
    from common.storage import open_storage
    from workers.train.commands import check_checkpoint
    from workers.train.drafter.export_files import check_export_dir

    store = RunStore(open_storage(settings.broker.storage, settings.read), run)
    config = store.config()  # a missing run or checkpoint: one line before torch is imported
    if check and drafter_dir is None:
        check_checkpoint(store.storage, run, step)
    elif check and drafter_dir is not None:
        check_export_dir(drafter_dir)
    return store, config


def _load(settings: Settings, run: str, config: Any, step: int | None,
          drafter_dir: str | None) -> tuple[Any, Any, int | None, Any]:
    """The target and the drafter on the training device: ``(target, drafter, step, device)``."""
    from workers.devices import resolve_device
    from workers.train.commands import load_run_drafter, load_run_target
    from workers.train.drafter.export import fit_problems, load_drafter

    device = resolve_device(settings.train.device, env_name("train_device"))
    if drafter_dir is not None:
        target = load_run_target(settings, config, device)
        drafter = load_drafter(drafter_dir, target.model, tokenizer=target.tokenizer)
        source_step = None
    else:
        loaded = load_run_drafter(settings, run, step, device)
        target, drafter, source_step = loaded.target, loaded.trainer.drafter, loaded.step
        problems = fit_problems(drafter.config, target.model)
        if problems:
            raise ConfigError(f"the checkpoint does not fit the target: {'; '.join(problems)}")
    target.model.to(device)
    drafter.to(device)
    return target, drafter, source_step, device


def _prompts(store: Any, config: Any, tokenizer: Any, path: str | None,
             num: int) -> tuple[list[Any], str]:
    from workers.train.evaluation import heldout_prompts, row_prompts

    if path is not None:
        # The shared input reader: every file layout enqueue accepts, with the run's settings.
        from workers.train.eval_datasets import file_rows

        rows = file_rows(config, path, num)
        return row_prompts(rows, tokenizer, config.sampling, num,
                           config.chat_template_kwargs), path
    manifest = store.manifest()
    if manifest is None:
        raise ConfigError(f"run {config.run!r} is still reading its input; pass --prompts")
    if not manifest.heldout:
        raise ConfigError(f"run {config.run!r} has no held-out split (enqueued before it "
                          "existed, or with --heldout-min 0 and no sample held out); pass "
                          "--prompts PATH")
    return heldout_prompts(store.storage, config, manifest, tokenizer, num), "heldout"


def render(result: dict[str, Any]) -> str:
    """The human-readable summary."""
    who = (f"drafter {result['drafter']}" if result["drafter"]
           else f"drafter step {result['step']}")
    lines = [
        f"run {result['run']}: {who} on {result['prompts']} {result['source']} prompts, block "
        f"{result['block_size']}, up to {result['max_new_tokens']} new tokens ({result['device']})",
        f"acceptance length tau {result['tau']:.3f} per prompt, {result['tau_pooled']:.3f} pooled "
        f"({result['tokens']} tokens, {result['steps']} verify steps, "
        f"{result['target_forwards_per_token']:.3f} target forwards per token)",
        "accepted length  steps",
    ]
    total = max(1, result["steps"])
    for length, count in result["accepted_hist"].items():
        if count:
            lines.append(f"  {int(length):>3}  {count:>8}  {'#' * round(40 * count / total)}")
    rates = " ".join(f"{k}:{p:.2f}" for k, p in enumerate(result["per_position"], 1))
    lines.append(f"per-position acceptance (k accepted given 1..k-1): {rates}")
    lossless = result["lossless"]
    equal = lossless["checked"] - len(lossless["mismatches"])
    lines.append(f"lossless: {equal}/{lossless['checked']} prompts decode exactly to the "
                 "target's greedy output")
    return "\n".join(lines)

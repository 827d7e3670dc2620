"""A run's options, each declared once: name, type, default, help, ``DFLASH_*`` variable and
whether run.json freezes it.

``enqueue``'s click options are made from these declarations
(:func:`common.cli.options_for`), the
settings reference and run.json's schema are generated from them, and the command hands one
:class:`RunOptions` whole to enqueue, which resolves it against the target and freezes the
:class:`common.runs.records.RunConfig` that every worker reads back. Adding an option is one field
here plus the code that uses it::

    epochs: int = run_option(RECIPE_EPOCHS, type=click.IntRange(min=1),
                             help="Passes the drafter trains over ...")   # in FrozenOptions

Defaults of values that fill a record (sampling, gates, the held-out split) are the record's
own, never restated; ``None`` means "as the target says" where the help shows what that is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

import click

from common.choices import EnumChoice, InputFormat, Layout, Mode
from common.declared import opt
from common.engine.sampling import MAX_NEW_TOKENS_CAP, Sampling
from common.gates.judge import SKIPPABLE_GATES, GateConfig
from common.runs.epochs import RECIPE_EPOCHS
from common.runs.splits import HELDOUT_FRACTION, HELDOUT_MIN

DRAFTER_LAYERS = 5   # DFlash's drafter depth for an 8B-class target (its published configs)


_MISSING: Any = MISSING


class FiniteRange(click.FloatRange):
    """click's ``FloatRange`` that refuses NaN and infinities (which pass every bound)."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        found = super().convert(value, param, ctx)
        if not math.isfinite(found):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return found


def run_option(default: Any = _MISSING, *, help: str,  # noqa: A002
               decls: tuple[str, ...] = (), commands: tuple[str, ...] = ("enqueue",),
               at: Mapping[str, Mapping[str, Any]] | None = None, **click_kw: Any) -> Any:
    """A declared run option: ``default`` (none: a required option), its ``--help`` text, extra
    flag names, click's own keywords, and the commands that take it (``enqueue``; ``at`` those
    that read it otherwise); whether run.json freezes it as given is its class."""
    return opt(default, help=help, decls=decls, commands=commands, env=True, at=at, **click_kw)


def _template_kwargs(ctx: click.Context, param: click.Parameter,
                     value: str | None) -> dict[str, Any] | None:
    """--chat-template-kwargs: a JSON object of template options, never enable_thinking."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON ({exc}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"must be a JSON object, e.g. '{{\"preserve_thinking\": "
                                 f"true}}', not {value!r}")
    if "enable_thinking" in parsed:
        raise click.BadParameter("enable_thinking is --thinking on|off|mix:R")
    return parsed


def _thinking(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--thinking: on, off or mix:R, checked here so a bad value is one usage error."""
    from common.engine.thinking import describe, parse_thinking

    try:
        return describe(*parse_thinking(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _unescape(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Let a shell user write a newline in --prompt-template as \\n (and a tab as \\t)."""
    return None if value is None else value.replace("\\n", "\n").replace("\\t", "\t")


_NEW_GATE = {"default": None, "envvar": None, "show_default": False}
"""``resume`` takes a gate's threshold unset: the run's stays unless given (a new one lifts a
pause too)."""


@dataclass(frozen=True, kw_only=True)
class FrozenOptions:
    """The run options run.json freezes as given, under their own names: the first fields of
    both :class:`RunOptions` and :class:`common.runs.records.RunConfig`."""

    run: str = run_option(
        required=True, help="Run id (letters, digits, ._-).",
        commands=("enqueue", "resume", "status", "report", "export-dataset", "export-drafter",
                  "eval-drafter"),
        at={"bench": {"required": False,
                      "help": "Bench the run's own prompts (their lengths, template, sampling "
                              "and MTP) on the engine the generate worker would start, and "
                              "project the run's hours."},
            "plan-storage": {"required": False,
                             "help": "Read samples, mean tokens and model size from this "
                                     "run's storage."},
            "plan-training": {"required": False,
                              "help": "Plan for this run: its target, drafter and committed "
                                      "rows."},
            "doctor": {"required": False, "envvar": None,
                       "help": "Also say whether this run's drafter training fits this host's "
                               "GPUs (the memory plan: plan-training)."},
            "demo": {"required": False, "envvar": None, "default": "mt-bench-demo",
                     "show_default": True, "help": "Run id."}})
    format: InputFormat = run_option(InputFormat.AUTO, type=EnumChoice(InputFormat),
                                     help="Row layout; auto detects it per row.")
    prompt_field: str | None = run_option(
        None, help="Field holding the prompt for --format prompt.")
    prompt_template: str | None = run_option(
        None, callback=_unescape,
        help="Build the prompt from the row's fields instead, e.g. '{instruction}\\n\\n"
             "{context}' (\\n is a newline); placeholders name fields only: {field} or "
             "{field:spec}.")
    strict_fields: bool = run_option(
        False, is_flag=True,
        help="Reject a row with text no prompt uses (a string, or text in a list or object "
             "field), instead of reporting it.")
    shard_size: int = run_option(256, type=click.IntRange(min=1),
                                 help="Conversations per shard (one task each).")
    limit: int | None = run_option(None, type=click.IntRange(min=1),
                                   help="Read at most this many input rows.")
    mode: Mode = run_option(
        Mode.OFFLINE, type=EnumChoice(Mode),
        help="After a shard's commit: offline stores target hidden states (queue hidden); "
             "online trains the drafter on the fly (queue train, nothing stored).")
    layout: Layout = run_option(Layout.DFLASH, type=EnumChoice(Layout),
                                help="Target layers kept for the drafter.")
    heldout_fraction: float = run_option(
        HELDOUT_FRACTION, type=FiniteRange(0, 1, max_open=True),
        help="Samples (by id hash) never trained on, decoded by eval-drafter.")
    heldout_min: int = run_option(HELDOUT_MIN, type=click.IntRange(min=0),
                                  help="Hold out at least this many samples (at most half a "
                                       "small input).")
    epochs: int = run_option(
        RECIPE_EPOCHS, type=click.IntRange(min=1),
        help="Passes the drafter trains over the run's training rows (the published DFlash "
             "recipe's 10); the learning-rate schedule is epochs x rows / rows per step long. "
             "Later epochs revisit the samples in a new seeded order.")
    max_train_tokens: int | None = run_option(
        None, type=click.IntRange(min=2),
        help="Train on the first N tokens of longer rows (SpecForge's recipe cuts at 4096) "
             "[default: whole rows; plan-training says what fits]; status counts the rows cut.")
    max_turns: int | None = run_option(
        None, type=click.IntRange(min=1),
        help="Regenerate at most this many assistant turns of a conversation "
             "[default: every turn].")
    patience: int | None = run_option(
        None, type=click.IntRange(min=1),
        help="Stop training after this many end-of-epoch evaluations without a better held-out "
             "acceptance length [default: never; every epoch trains].")


    def __post_init__(self) -> None:
        # A choice is its member from here on, however it came (click, run.json, a test's text).
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "layout", Layout(self.layout))
        object.__setattr__(self, "format", InputFormat(self.format))


@dataclass(frozen=True, kw_only=True)
class RunOptions(FrozenOptions):
    """What ``enqueue`` is asked: the options above, and those resolved against the target
    into run.json's records (input, sampling, gates, the drafter's shape).
    """

    input: tuple[str, ...] = run_option(
        required=True, multiple=True,
        help="A JSONL/JSON/Parquet/Arrow file, a directory of them (a Hugging Face dataset "
             "too), a quoted glob, or s3://bucket/key, prefix/ or glob; repeatable.")
    max_new_tokens: int | None = run_option(
        None, type=click.IntRange(min=1),
        help="Generation budget per assistant turn [default: what the target's context "
             f"allows, at most {MAX_NEW_TOKENS_CAP}; each request is capped to the room its "
             "prompt leaves].")
    temperature: float | None = run_option(
        None, type=FiniteRange(min=0),
        help="Sampling temperature (0 = greedy) [default: the target's generation_config.json, "
             f"else {Sampling.temperature:g}].")
    top_p: float | None = run_option(
        None, type=FiniteRange(min=0, max=1, min_open=True),
        help=f"Nucleus sampling mass [default: the target's, else {Sampling.top_p:g}].")
    top_k: int | None = run_option(None, type=click.IntRange(min=-1),
                                   help="Top-k sampling (-1 = off) [default: the target's, "
                                        f"else {Sampling.top_k}].")
    min_p: float | None = run_option(None, type=FiniteRange(min=0, max=1),
                                     help="Min-p sampling [default: the target's, else "
                                          f"{Sampling.min_p:g}].")
    repetition_penalty: float | None = run_option(
        None, type=FiniteRange(min=0, max=2, min_open=True),
        help="Repetition penalty (1 = off) [default: the target's, else "
             f"{Sampling.repetition_penalty:g}].")
    presence_penalty: float | None = run_option(
        None, type=FiniteRange(min=-2, max=2),
        help=f"Presence penalty [default: the target's, else {Sampling.presence_penalty:g}].")
    thinking: str = run_option(
        "on", metavar="on|off|mix:R", is_flag=False, flag_value="on", callback=_thinking,
        help="Render prompts with thinking on, off, or off for a stable share R of "
             "conversations chosen by id (mix:0.5); each sample records its mode.")
    no_thinking: bool = run_option(False, is_flag=True, help="The same as --thinking off.")
    chat_template_kwargs: dict[str, Any] | None = run_option(
        None, callback=_template_kwargs, metavar="JSON",
        help="Options every render passes to the target's chat template, frozen in run.json, "
             "e.g. '{\"preserve_thinking\": true}' (thinking itself: --thinking).")
    target_layers: str | None = run_option(
        None,
        help="Target layers of the dflash layout: K (the DFlash spread of K layers), a comma "
             "list of layer ids, or dflash|full-attention|after-full[:K] [default: dflash (5 "
             "layers) on a dense target, after-full on a hybrid; with --drafter-config/"
             "--init-drafter: its dflash_config.target_layer_ids].")
    drafter_layers: int = run_option(
        DRAFTER_LAYERS, type=click.IntRange(min=1),
        help="Decoder layers of the run's drafter when neither --drafter-config nor "
             "--init-drafter shapes it (the target gives the rest); frozen in run.json with "
             "the shape.")
    drafter_config: str | None = run_option(
        None, metavar="FILE",
        help="Shape the run's drafter as this published DFlash config.json says (layers, "
             "sliding windows, heads, block, target layers; the target gives the rest). Checked "
             "against the target now and frozen in run.json with its digest: every train "
             "worker trains this shape. Its target_layer_ids become the run's target layers "
             "(--target-layers, if given, must agree).")
    init_drafter: str | None = run_option(
        None, metavar="DIR",
        help="Start the run's drafter from a released DFlash drafter (config.json + "
             "safetensors, as export-drafter writes and z-lab publishes): its shape is checked "
             "and frozen as with --drafter-config, and its directory and weights digest too; "
             "train workers read it at that path and verify the digest.")
    min_supervised_tokens: int = run_option(
        GateConfig.min_supervised_tokens, type=click.IntRange(min=0),
        help="Reject a sample with a turn of fewer generated tokens (2 x the DFlash block "
             "size).")
    max_reject_rate: float = run_option(
        GateConfig.max_reject_rate, type=FiniteRange(0, 1), at={"resume": _NEW_GATE},
        help="Pause the run when the rolling rejection rate exceeds this.")
    pause_after: int = run_option(GateConfig.pause_after, type=click.IntRange(min=1),
                                  at={"resume": _NEW_GATE},
                                  help="Samples the rolling rejection rate is taken over.")
    min_answer_tokens: int = run_option(
        GateConfig.min_answer_tokens, type=click.IntRange(min=0),
        help="Reject at enqueue a prompt that leaves less room than this per answer in the "
             "model's context; at generation, a turn whose prompt leaves less in the server's "
             "context is not sent (context_overflow).")
    skip_gate: tuple[str, ...] = run_option(
        (), multiple=True, type=click.Choice(list(SKIPPABLE_GATES)),
        help="Turn a per-sample gate off (repeatable).")

    @classmethod
    def from_cli(cls, values: Mapping[str, Any]) -> RunOptions:
        """The options from click's parameters (each named as its field)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    @property
    def thinking_mode(self) -> str:
        """``--thinking``, with ``--no-thinking`` taken as ``off``."""
        return "off" if self.no_thinking else self.thinking

    def gates(self) -> GateConfig:
        """The gate thresholds, with the skipped gates turned off."""
        return GateConfig(
            min_supervised_tokens=self.min_supervised_tokens,
            max_reject_rate=self.max_reject_rate, pause_after=self.pause_after,
            min_answer_tokens=self.min_answer_tokens,
            **{flag: gate not in self.skip_gate for gate, flag in SKIPPABLE_GATES.items()})


def as_given(options: RunOptions) -> dict[str, Any]:
    """The options run.json freezes as given, by name."""
    return {f.name: getattr(options, f.name) for f in fields(FrozenOptions)}


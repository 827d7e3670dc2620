"""What a generate worker (or ``bench --run``) can do with the target's own MTP head, and the
configuration its engine starts in.

    worker = MtpWorker.of(settings, TargetShape.from_dir(model_dir))   # once, at start
    choice = worker.start()      # DFLASH_MTP: auto|on|off, before any run is known
    log.info(choice.line())      # "mtp on (auto): the target states an MTP head ..."
    argv = engine_command(settings, model_dir, choice.args)

Per run, the worker turns it on or off by :func:`decide_mtp` (the run's sampling, its bench
verdict, else the worker's own measurement on the run's shards, :class:`Measured`; ``bench
--run`` asks the same function which configurations it may measure); each choice names its
:class:`~common.choices.MtpSource`. ``auto`` starts on where the target states an MTP head (in
its config and its weights: :attr:`TargetShape.has_mtp`) and SGLang verifies with a sampled
verify (a GPU), as the first configuration a run's measurement takes; the flags are
:func:`common.engine.serving.mtp_engine_args` (SGLang's Qwen3.5/3.6 recipe) plus what the pinned
SGLang needs for a hybrid (:func:`hybrid_spec_args`). A user's own
``--speculative-algorithm`` in ``DFLASH_ENGINE_ARGS`` wins over all of it; other
``--speculative-*`` tuning flags there only tune ours. ``on`` where MTP cannot run (no head, the
CPU engine, a server started elsewhere) is an :class:`OptionRefused` (one ``error:`` line, exit
2). Lossless or refused: :mod:`common.engine.lossless`.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from common.choices import EngineKind, MambaStrategy, MtpMode, MtpSource, SpecAlgorithm
from common.config import Settings
from common.engine.lossless import (
    ARGMAX_PLATFORMS,
    GREEDY_SOURCE,
    engine_platform,
    flag_value,
    inexact,
    lossless_refusal,
)
from common.engine.serving import (
    ENGINE_ARGS_FIELD,
    MTP_DRAFT_TOKENS,
    MTP_STEPS,
    MTP_TOPK,
    mtp_engine_args,
)
from common.engine.target import NO_MTP_HEAD, TargetShape
from common.errors import ConfigError, OptionRefused

if TYPE_CHECKING:
    from common.engine.sampling import Sampling


class MeasuredPick(Protocol):
    """A bench verdict's answer at one concurrency (common.runs.bench_verdict.Pick)."""

    @property
    def on(self) -> bool: ...

    @property
    def clear(self) -> bool: ...

    def line(self) -> str: ...

    def follow(self, current: bool) -> bool: ...


class Verdict(Protocol):
    """A stored bench verdict as the decision reads it (common.runs.bench_verdict.Verdict)."""

    def at(self, in_flight: int) -> MeasuredPick | None: ...


# SGLang resolves the hybrid's mamba radix cache "auto" to extra_buffer on a GPU with the overlap
# scheduler (srt/arg_groups/overrides.py _mamba_radix_cache_resolution); stated here, so the
# slots this project computes (common.engine.serving.mamba_slots_per_request) are SGLang's.
MAMBA_STRATEGY = MambaStrategy.EXTRA_BUFFER


@dataclass(frozen=True)
class Measured:
    """Where a worker's own measurement of a run stands (:mod:`common.engine.mtp_measure`): the
    configuration it runs (``on``), both rates once measured (else None) and why."""

    on: bool
    rates: Mapping[str, float] | None
    reason: str


NOT_MEASURED = Measured(True, None, "no bench verdict for this worker: measuring mtp on first, "
                                    "then off, on the run's shards at this worker's load")


@dataclass(frozen=True)
class MtpChoice:
    """What a worker asked (``mode``), what its engine does (``on``, ``args``), why and what
    decided it (``source``)."""

    mode: MtpMode
    on: bool
    reason: str
    source: MtpSource
    device: str = "cuda"                # the platform SGLang verifies on
    args: tuple[str, ...] = ()
    user_algorithm: str | None = None   # DFLASH_ENGINE_ARGS' own --speculative-algorithm
    rates: Mapping[str, float] | None = None   # "on"/"off" tok/s of the measurement followed

    @property
    def algorithm(self) -> str | None:
        """The speculative algorithm the engine is launched with (ours or the user's)."""
        return SpecAlgorithm.NEXTN if self.on else self.user_algorithm

    def line(self) -> str:
        return f"mtp {'on' if self.on else 'off'} ({self.mode}): {self.reason}"


def _argv(engine_args: str | Sequence[str]) -> list[str]:
    return shlex.split(engine_args) if isinstance(engine_args, str) else list(engine_args)


def target_shape(model_dir: Path) -> TargetShape | None:
    """The target's shape, or None when its directory has no config.json to state one."""
    return TargetShape.from_dir(model_dir) if (model_dir / "config.json").is_file() else None


def engine_device(settings: Settings, env: Mapping[str, str] | None = None) -> str:
    """The platform SGLang verifies on (:func:`common.engine.lossless.engine_platform`); the
    CPU engine is ``cpu``."""
    if settings.generate.engine is not EngineKind.SGLANG:
        return "cpu"
    return engine_platform(settings.generate.engine_args, os.environ if env is None else env)


# The strategies that keep an extra buffer on a GPU (auto resolves to one with the overlap
# scheduler, which MTP's verify runs under).
_EXTRA_BUFFERS = (MambaStrategy.AUTO, MambaStrategy.EXTRA_BUFFER, MambaStrategy.EXTRA_BUFFER_LAZY)


def hybrid_spec_args(shape: TargetShape, engine_args: str | Sequence[str],
                     draft_tokens: int = MTP_DRAFT_TOKENS) -> list[str]:
    """What the pinned SGLang needs beyond the NEXTN flags to verify drafts on a hybrid: the
    mamba radix cache strategy stated (unless the user's args name one, or no radix cache)."""
    argv = _argv(engine_args)
    if not shape.is_hybrid or "--disable-radix-cache" in argv:
        return []
    strategy = flag_value(argv, "--mamba-radix-cache-strategy")
    interval = flag_value(argv, "--mamba-track-interval")
    extra = strategy is None or MambaStrategy.parse(strategy) in _EXTRA_BUFFERS
    if extra and interval and interval.isdigit() and int(interval) < draft_tokens:
        raise OptionRefused(f"--mamba-track-interval {interval} is below the {draft_tokens} "
                            "draft tokens MTP verifies; SGLang refuses that with the "
                            "extra_buffer mamba cache (mamba_hook.py validate_mamba_extra_buffer)")
    return [] if strategy else ["--mamba-radix-cache-strategy", MAMBA_STRATEGY.value]


@dataclass(frozen=True)
class MtpWorker:
    """What one worker can do: its mode, platform, the NEXTN flags where it can generate through
    the head (else why not), and the user's own algorithm, if any."""

    mode: MtpMode
    device: str
    head_args: tuple[str, ...] | None
    cannot: str | None = None
    user_algorithm: str | None = None

    @classmethod
    def of(cls, settings: Settings, shape: TargetShape | None,
           env: Mapping[str, str] | None = None) -> MtpWorker:
        """OptionRefused for ``--mtp on`` where MTP cannot run."""
        mode, device = settings.generate.mtp, engine_device(settings, env)
        user = flag_value(_argv(settings.generate.engine_args), "--speculative-algorithm")
        cannot = _cannot(settings, shape)
        if cannot is not None or user is not None:
            if mode is MtpMode.ON and cannot is not None:
                raise OptionRefused(f"--mtp on: {cannot}")
            return cls(mode, device, None, cannot, user)
        assert shape is not None   # _cannot: a head is stated
        args = (*mtp_engine_args(shape), *hybrid_spec_args(shape, settings.generate.engine_args))
        return cls(mode, device, args)

    def turned(self, on: bool, reason: str, source: MtpSource,
               rates: Mapping[str, float] | None = None) -> MtpChoice:
        """The engine's configuration with MTP ``on`` (where it can run) or off, why, what
        decided it (and the rates it measured)."""
        if self.user_algorithm is not None:
            return MtpChoice(self.mode, False, f"DFLASH_ENGINE_ARGS sets --speculative-algorithm "
                             f"{self.user_algorithm} (the user's speculative flags win)",
                             MtpSource.FORCED, self.device, user_algorithm=self.user_algorithm)
        if on and self.head_args is not None:
            return MtpChoice(self.mode, True, reason, source, self.device, self.head_args,
                             rates=rates)
        return MtpChoice(self.mode, False, reason, source, self.device, rates=rates)

    def start(self) -> MtpChoice:
        """The configuration before any run is known: ``auto`` on where a head is stated and
        SGLang's verify samples (a GPU): the first a run's own measurement takes."""
        if self.mode is MtpMode.OFF:
            return self.turned(False, "asked off", MtpSource.FORCED)
        if self.head_args is None:
            return self.turned(False, self.cannot or "", MtpSource.NO_HEAD)
        where = (f"{ARGMAX_PLATFORMS[self.device]} (greedy runs only)"
                 if self.device in ARGMAX_PLATFORMS else "the GPU")
        if self.mode is MtpMode.AUTO and self.device in ARGMAX_PLATFORMS:
            return self.turned(False, f"SGLang runs on {ARGMAX_PLATFORMS[self.device]}, where "
                               f"its verify commits the argmax even when sampling "
                               f"({GREEDY_SOURCE}); greedy runs are measured",
                               MtpSource.SAMPLING)
        if self.mode is MtpMode.ON:
            return self.turned(True, f"asked on, SGLang on {where}: {self.recipe()}",
                               MtpSource.FORCED)
        return self.turned(True, f"the target states an MTP head, SGLang on {where}: "
                                 f"{self.recipe()}; each run follows its bench verdict, else "
                                 f"this worker's measurement of on, then off", MtpSource.MEASURED)

    def recipe(self) -> str:
        hybrid = self.head_args is not None and "--mamba-radix-cache-strategy" in self.head_args
        return (f"{SpecAlgorithm.NEXTN}, {MTP_STEPS} steps, top-{MTP_TOPK}, "
                f"{MTP_DRAFT_TOKENS} tokens verified per step"
                + (" (hybrid: mamba radix cache extra_buffer)" if hybrid else ""))

    def can(self) -> bool:
        return self.head_args is not None


def choose_mtp(settings: Settings, shape: TargetShape | None,
               env: Mapping[str, str] | None = None) -> MtpChoice:
    """The worker's starting configuration from ``settings.generate.mtp`` and the target's own
    files (``shape``: None where it has no config.json, which states no head)."""
    return MtpWorker.of(settings, shape, env).start()


def decide_mtp(worker: MtpWorker, run: str, sampling: Sampling, verdict: Verdict | None,
               in_flight: int, engine_args: str, env: Mapping[str, str],
               measured: Measured | None = None, running: bool | None = None) -> MtpChoice:
    """The one decision (worker and ``bench``): MTP on or off for ``run`` on ``worker``, why
    and its source; under ``auto`` without a verdict, where the worker's own measurement
    (``measured``) stands; a verdict with no clear winner keeps the configuration the engine
    is ``running`` (None: not started, the measurement's or the start's). ConfigError (the
    shard parks) where ``--mtp on`` or the user's own algorithm would not keep the run's
    sampling."""
    if worker.user_algorithm is not None:
        choice = worker.turned(False, "", MtpSource.FORCED)
        refusal = lossless_refusal(choice.algorithm, worker.device, sampling, engine_args, env)
        if refusal is not None:
            raise ConfigError(f"run {run}: {refusal}")
        return choice
    if worker.mode is MtpMode.OFF or not worker.can():
        return worker.start()
    nextn = SpecAlgorithm.NEXTN
    refusal = lossless_refusal(nextn, worker.device, sampling, engine_args, env)
    if refusal is not None:
        if worker.mode is MtpMode.ON:
            raise ConfigError(f"run {run}: --mtp on: {refusal}")
        why = "; ".join(inexact(nextn, worker.device, sampling, engine_args, env))
        return worker.turned(False, f"the run's sampling is not kept exactly by SGLang's "
                                    f"speculative verify: {why}", MtpSource.SAMPLING)
    if worker.mode is MtpMode.ON:
        return worker.turned(True, f"asked on: {worker.recipe()}", MtpSource.FORCED)
    pick = verdict.at(in_flight) if verdict is not None else None
    if pick is None:
        m = measured or NOT_MEASURED
        return worker.turned(m.on, m.reason + (f" ({worker.recipe()})" if m.on else ""),
                             MtpSource.MEASURED, m.rates)
    if not pick.clear:
        current = running if running is not None else (
            measured.on if measured is not None else worker.start().on)
        on = pick.follow(current)
        return worker.turned(on, f"{pick.line()} at {in_flight} in flight"
                             + (f" ({worker.recipe()})" if on else ""), MtpSource.BENCH)
    verb = "faster" if pick.on else "not faster"
    return worker.turned(pick.on, f"{pick.line()}: mtp on is {verb} at {in_flight} in flight"
                         + (f" ({worker.recipe()})" if pick.on else ""), MtpSource.BENCH)


def _cannot(settings: Settings, shape: TargetShape | None) -> str | None:
    """Why this worker cannot generate through the MTP head, or None."""
    if settings.generate.engine is not EngineKind.SGLANG:
        return "the CPU engine has no speculative decoding (use --engine sglang)"
    if settings.generate.engine_url:
        return ("the server at --engine-url runs with the flags it was started with (start it "
                f"with the {SpecAlgorithm.NEXTN} flags of `serve-command mtp`)")
    if settings.generate.engine_cmd and ENGINE_ARGS_FIELD not in settings.generate.engine_cmd:
        return f"--engine-cmd has no {ENGINE_ARGS_FIELD} field to pass the MTP flags"
    if shape is None or not shape.has_mtp:
        return (shape.mtp_missing if shape is not None and shape.mtp_missing else NO_MTP_HEAD)
    return None

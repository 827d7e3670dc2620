"""Every closed set of values a user or an engine names, as ``str`` enums: parsed once at the edge
(the CLI, run.json, a ``DFLASH_*`` variable, an engine's answer) and compared as members after.

A member equals its text (``Mode.ONLINE == "online"``), so run.json and ``--json`` keep their
strings; :class:`EnumChoice` makes a click option of one and hands the command the member.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import click


class Mode(StrEnum):
    """What follows a shard's commit: stored hidden states (offline) or training (online)."""

    OFFLINE = "offline"
    ONLINE = "online"


class Layout(StrEnum):
    """Which target layers feed the drafter."""

    DFLASH = "dflash"
    EAGLE3 = "eagle3"


class MtpMode(StrEnum):
    """Generation through the target's own MTP head: auto decides per run by its bench
    (:func:`common.engine.mtp.decide_mtp`)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class MtpSource(StrEnum):
    """What decided a run's MTP configuration on a worker (``status``' ``source``)."""

    BENCH = "bench"            # the run's bench verdict for this GPU, TP and engine
    MEASURED = "measured"      # auto without a verdict: the worker's own measurement (or its
    #                            window now: the record's rates are null until both are taken)
    SAMPLING = "sampling"      # the run's sampling, which the speculative verify does not keep
    FORCED = "forced"          # --mtp on/off, or the user's own --speculative-algorithm
    NO_HEAD = "no head"        # the worker cannot generate through a head (none, CPU, URL)


class SpecAlgorithm(StrEnum):
    """SGLang's EAGLE-family speculative algorithms (``--speculative-algorithm``); NEXTN
    drafts through the target's own MTP head."""

    NEXTN = "NEXTN"
    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"

    @classmethod
    def parse(cls, raw: str | None) -> SpecAlgorithm | None:
        """A flag's value as SGLang reads it (any case); None for another algorithm or none."""
        try:
            return cls(raw.upper()) if raw else None
        except ValueError:
            return None


class Checkpointing(StrEnum):
    """Recompute the drafter's layers in the backward: auto where the memory plan says so."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class EngineKind(StrEnum):
    """The generate stage's engine: the embedded CPU engine or an SGLang server."""

    CPU = "cpu"
    SGLANG = "sglang"


class TinyModel(StrEnum):
    """The embedded CPU targets, built on first use (their builder is :mod:`embedded`'s)."""

    QWEN3 = "tiny-qwen3"       # dense, Qwen3's template: the default model
    QWEN3_5 = "tiny-qwen3.5"   # a hybrid in Qwen3.6's shape
    MIMO = "tiny-mimo"         # dense with its own MTP head, in MiMo's shape

    @classmethod
    def named(cls, model: str) -> TinyModel | None:
        """The member a model setting names, or None for any other model (a directory)."""
        try:
            return cls(model)
        except ValueError:
            return None


class FinishReason(StrEnum):
    """Why an engine stopped a turn (SGLang's ``meta_info.finish_reason.type``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @classmethod
    def parse(cls, raw: object) -> FinishReason:
        """An engine's or a stored sample's reason; anything else reads as an abort."""
        try:
            return cls(str(raw))
        except ValueError:
            return cls.ABORT


class Parallel(StrEnum):
    """How a training group lays the drafter over its ranks (``DFLASH_TRAIN_PARALLEL``)."""

    DDP = "ddp"     # a replica of the drafter and its optimizer state on each rank
    FSDP = "fsdp"   # FSDP2: both sharded over the ranks


class Attention(StrEnum):
    """The drafter's attention kernel in training (``TrainConfig.attention``)."""

    AUTO = "auto"   # flex on CUDA where it is available, else dense SDPA
    FLEX = "flex"   # flex attention over a block mask (no dense mask kept)
    SDPA = "sdpa"   # dense masks through scaled_dot_product_attention


class MambaStrategy(StrEnum):
    """SGLang's ``--mamba-radix-cache-strategy`` (its choices, ``arg_groups/fields/exec_.py``)."""

    AUTO = "auto"
    NO_BUFFER = "no_buffer"
    EXTRA_BUFFER = "extra_buffer"
    EXTRA_BUFFER_LAZY = "extra_buffer_lazy"

    @classmethod
    def parse(cls, raw: str | None) -> MambaStrategy | None:
        """A flag's value as given; None for none (or one SGLang would refuse)."""
        try:
            return cls(raw) if raw is not None else None
        except ValueError:
            return None


class RankOrder(StrEnum):
    """What rank 0 of a training group tells the other ranks (the first item of a message)."""

    SESSION = "session"   # build the run's session at this step
    STATE = "state"       # gather the trainer's state (a checkpoint)
    WEIGHTS = "weights"   # gather the drafter's weights (an eval)
    TRAIN = "train"       # train this share of a step
    SELF = "self"         # rank 0's own share: it trains it in place
    STOP = "stop"         # rank 0 is leaving: so do the others


class ExportFormat(StrEnum):
    """``export-dataset --format``: the files' layout."""

    PARQUET = "parquet"           # Hugging Face datasets
    SPECFORGE = "specforge"       # SpecForge's conversations JSONL
    MESSAGES = "messages"         # OpenAI-style messages JSONL
    SPECULATORS = "speculators"   # input_ids + loss_mask per assistant turn


class WeightsDtype(StrEnum):
    """``export-drafter --dtype``: the exported weights' dtype; auto: the target's."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class FileKind(StrEnum):
    """An input file's kind, from its extension (:func:`common.inputs.readers.detect_kind`)."""

    JSONL = "jsonl"       # one row per line (also .ndjson), read as a stream
    JSON = "json"         # one array of rows (or one row), read whole
    PARQUET = "parquet"
    ARROW = "arrow"


class Compression(StrEnum):
    """An input file's compression, from its extension."""

    GZIP = "gzip"
    ZSTD = "zstd"


class RowLayout(StrEnum):
    """The layout one input row was read in (:mod:`common.inputs.layouts`)."""

    MESSAGES = "messages"
    SHAREGPT = "sharegpt"
    MT_BENCH = "mt_bench"
    ULTRACHAT = "ultrachat"
    INSTANCES = "instances"
    DOLLY = "dolly"
    ALPACA = "alpaca"
    PROMPT = "prompt"
    TEMPLATE = "template"   # --prompt-template: the row's fields as the template names them


class InputFormat(StrEnum):
    """``--format``: one row layout for every row, or auto (each row's from its keys)."""

    AUTO = "auto"
    MESSAGES = "messages"
    SHAREGPT = "sharegpt"
    MT_BENCH = "mt_bench"
    ULTRACHAT = "ultrachat"
    INSTANCES = "instances"
    DOLLY = "dolly"
    ALPACA = "alpaca"
    PROMPT = "prompt"

    def layout(self) -> RowLayout | None:
        """The layout every row is read in; None for auto."""
        return None if self is InputFormat.AUTO else RowLayout(self.value)


class ShardState(StrEnum):
    """One generate shard's state, as ``status`` counts it and the dashboard's grid shows it."""

    COMMITTED = "committed"
    RUNNING = "running"      # a live lease
    HEALING = "healing"      # the reconciler queued it again
    RETRYING = "retrying"    # waiting out its backoff
    PENDING = "pending"
    PARKED = "parked"        # out of deliveries, with its reason
    UNKNOWN = "unknown"      # Redis is down: only the commit is known


class RunState(StrEnum):
    """A run's state, as ``status`` reads it."""

    ENQUEUING = "enqueuing"
    PENDING = "pending"
    RUNNING = "running"
    STALLED = "stalled"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"


class TaskOutcome(StrEnum):
    """What a stage's task did with its shard (the task's result)."""

    COMMITTED = "committed"
    ALREADY_COMMITTED = "already-committed"
    PARKED = "parked"
    PAUSED = "paused"
    LOST = "lost"  # another worker took the lease over and finishes the shard
    REFUSED = "refused"  # not a task of any run: acked, nothing touched


class Reason(StrEnum):
    """Why the quality gates rejected a turn (a sample's ``quality.reasons``)."""

    TRUNCATED = "truncated"
    THINKING_MISSING = "thinking_missing"
    THINKING_UNCLOSED = "thinking_unclosed"
    EMPTY_ANSWER = "empty_answer"
    TOO_FEW_TOKENS = "too_few_tokens"
    TEMPLATE_LEAKAGE = "template_leakage"
    THINK_IN_ANSWER = "think_in_answer"     # a think marker after the block closed
    DUPLICATE = "duplicate"
    # Decided by the engine, not the output: the turn was never generated.
    CONTEXT_OVERFLOW = "context_overflow"   # the prompt leaves no room to answer
    ENGINE_REFUSED = "engine_refused"       # the engine answered 4xx for this request
    ENGINE_MISMATCH = "engine_mismatch"     # the response's token counts disagree with its ids


class Finish(StrEnum):
    """Why a run's training ended (the ledger's ``finished``)."""

    SCHEDULE = "schedule"          # every epoch trained: the schedule's last step ran
    TOTAL_STEPS = "total-steps"    # an explicit --total-steps ran out before the data did
    PATIENCE = "patience"          # --patience epochs without a better held-out tau


class OriginKind(StrEnum):
    """What shaped a run's drafter."""

    DEFAULT = "default"   # the target's shape, --drafter-layers deep
    CONFIG = "config"     # --drafter-config FILE
    INIT = "init"         # --init-drafter DIR: shape and starting weights


class RowKind(StrEnum):
    """The kinds of JSONL object a reader streams."""

    INPUT = "input shard"       # runs/<run>/inputs/shard-*.jsonl.zst: enqueue's rows
    SAMPLES = "samples part"    # generated/ and rejected/ parts: one sample per line
    OTHER = "jsonl object"      # anything else (rejected input rows, ...): the defaults


class Role(StrEnum):
    """A chat message's role, as rows and samples store it."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    CALL = "call"   # internal (common.inputs.rows): an assistant message that calls tools


class Stage(StrEnum):
    """A pipeline stage: its queue, its shard registry, its commit area."""

    GENERATE = "generate"
    HIDDEN = "hidden"
    TRAIN = "train"


class GateEvent(StrEnum):
    """A run monitor's gate record under gates/: a pause, or the resume that lifts it."""

    PAUSE = "pause"
    RESUME = "resume"


class Rollback(StrEnum):
    """How a hybrid target's linear-attention state returns to the accepted prefix
    (:mod:`workers.train.drafter.target_cache`)."""

    REPLAY = "replay"         # restore the snapshot, re-advance by the saved inputs
    REFEED = "refeed"         # restore, crop and feed the accepted tokens again
    PER_TOKEN = "per-token"   # step the verify token by token, pick the kept state


class FaultAction(StrEnum):
    """A test fault's message with a fixed meaning (:mod:`common.faults`); any other message
    is an error's text, ``sleep:S`` or ``oom@N``."""

    KILL = "kill"   # the process kills itself with SIGKILL


class EvalEngine(StrEnum):
    """What decodes ``eval-drafter --dataset``'s sets: our lossless loop, or an SGLang server."""

    LOCAL = "local"
    SGLANG = "sglang"


class EnumChoice(click.Choice[str]):
    """A click choice of an enum's values that hands the command the member."""

    def __init__(self, enum: type[StrEnum], case_sensitive: bool = True) -> None:
        super().__init__([member.value for member in enum], case_sensitive)
        self.enum = enum

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, self.enum):   # a default given as the member
            return value
        return self.enum(super().convert(value, param, ctx))

"""What ``status`` reads of a run, as one typed record: the text, ``--json`` and dashboard
renderers read these fields (``--json`` prints it as is, so its field names are the contract).

Every part is typed, nested ones too; records read from Redis or storage keep the type their
schema validated (:mod:`common.runs.schemas`). ``state`` is a :class:`RunState`, which ``--json``
writes as its text. The trainer's metrics record is open (the trainer adds figures over time):
its known fields are named in :class:`TrainFigures`, others pass through to ``--json`` unnamed.
"""

from __future__ import annotations

from typing import NotRequired

from typing_extensions import TypedDict  # pydantic reads it on Python 3.11 (tests do)

from common.choices import RunState
from common.drafter.origin import DrafterSummary
from common.engine.speculative import MtpChoice, SpeculativeFigures
from common.runs.schemas import EngineRecord, PauseRecord


class RedisView(TypedDict):
    reachable: bool
    monitor_ready: bool


class ShardCounts(TypedDict):
    """Generate-stage shards; the Redis-side counts (running .. parked): None while it is down."""

    total: int
    committed: int
    uncommitted: int
    running: int | None
    healing: int | None
    retrying: int | None
    pending: int | None
    parked: int | None


class SampleCounts(TypedDict):
    total: int | None
    done: int
    in_progress: int
    rejected: int
    input_rejected: int
    gate_rejected: int


class GateWindow(TypedDict):
    size: int
    rejected: int
    rate: float


class TurnCounts(TypedDict):
    judged: int
    rejected: int


class ThinkingCounts(TypedDict):
    on: int
    off: int


class GateCounts(TypedDict):
    """Conversations checked and rejected (turns: a conversation stops at its first rejected
    turn); window, turns and thinking only from the run monitor's live counters."""

    checked: int
    rejected: int
    rate: float
    window: GateWindow | None
    turns: TurnCounts | None
    thinking: ThinkingCounts | None
    reasons: dict[str, int]


class TokenCounts(TypedDict):
    generated: int
    per_s: float | None


class ParkedShard(TypedDict):
    stage: str
    shard: int
    reason: str


class EvalError(TypedDict):
    message: str
    step: int


class TrainFigures(TypedDict, total=False):
    """The trainer's progress: the live metrics record (Redis text, else the newest
    checkpoint's numbers) with the ledger's epoch, schedule and learning rate as numbers."""

    epoch: int | None
    epochs: int
    step: int | None
    total_steps: int | None
    lr: float | None
    eta_s: float | None
    tau_by_epoch: list[float | None]
    finished: str | None
    epoch_hours_planned: float | None
    epoch_hours_measured: float | None
    oom_retries: int
    slot_accuracy: list[int | float | None] | None   # per slot (JSON text in Redis)
    tau_per_position: list[int | float | None] | None
    # As the trainer wrote them (text in Redis, numbers in a checkpoint's metrics).
    loss: str | float
    slot1_accuracy: str | float
    acceptance_length: str | float
    tokens_per_s: str | float
    ranks: str | int
    hosts: str | int
    memory_plan: str
    tau: str | float
    tau_step: str | int
    eval_error: str
    eval_error_step: str | int


class Downstream(TypedDict):
    """The hidden-state stage's commits (offline) or the trainer's progress (online: the
    fields marked NotRequired are there)."""

    mode: str
    stage: str
    committed: int
    parked: int | None
    rows_set_aside: dict[str, int]
    train: NotRequired[TrainFigures]
    memory_plan: NotRequired[str | None]
    finished: NotRequired[str | None]
    tau: NotRequired[float | None]
    tau_step: NotRequired[int | None]
    eval_error: NotRequired[EvalError | None]


class RunStatus(TypedDict):
    """One ``status`` reading (``status --json``'s object)."""

    run: str
    state: RunState
    storage: str
    model: str
    redis: RedisView
    shards: ShardCounts
    samples: SampleCounts
    gates: GateCounts
    pause: PauseRecord | None
    reason: str | None
    tokens: TokenCounts
    samples_per_s: float | None
    eta_s: float | None
    parked: list[ParkedShard] | None
    engines: dict[str, EngineRecord] | None
    speculative: dict[str, SpeculativeFigures] | None   # per worker: algorithm and figures
    mtp: dict[str, MtpChoice] | None    # per worker: whether it generates through MTP, why
    downstream: Downstream              # the hidden stage's commits or the trainer's progress
    drafter: DrafterSummary | None
    foreign_objects: dict[str, int]

"""The type of every record the pipeline stores, as readers check it (:mod:`common.reads`).

    commit = read_json(storage, key, GENERATED_COMMIT)    # a dict of exactly these types

Each record is a ``TypedDict`` of what its readers use, its atoms strict (an integer is never a
string or a bool, counts are never negative, a float may be written as an integer); fields
readers do not use are let through untyped. Old records read on: a field added later is
optional. A value of the wrong type anywhere makes the whole object foreign.
"""

from __future__ import annotations

from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,  # pydantic's on Python 3.11
)

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter
from typing_extensions import TypedDict

Int = StrictInt
Count = Annotated[StrictInt, Field(ge=0)]
Str = StrictStr
Number = StrictInt | StrictFloat
Share = Annotated[StrictInt | StrictFloat, Field(ge=0, le=1)]
TOKEN_IDS = 2**31   # token ids a vocabulary can hold (what training tensors and export take)
Ids = list[Annotated[StrictInt, Field(ge=0, lt=TOKEN_IDS)]]


# --- generated samples (parts) and input rows --------------------------------------------

class Turn(TypedDict):
    prompt_ids: Ids
    output_ids: Ids
    finish_reason: NotRequired[Str]
    prompt_tokens: NotRequired[Count]
    completion_tokens: NotRequired[Count]


class Quality(TypedDict):
    passed: StrictBool
    reasons: list[Str]
    details: NotRequired[list[Str]]
    supervised_tokens: NotRequired[list[Count]]
    judged_at: NotRequired[Number]
    answer_hash: NotRequired[Str | None]
    turns_passed: NotRequired[Count]
    thinking: NotRequired[StrictBool]
    stopped: NotRequired[dict[Str, Any] | None]


class Sample(TypedDict):
    """One line of a generated (or rejected) part (what a writer always writes, typed where
    present: a reader of parts needs only the id and what it counts)."""

    id: Str
    messages: NotRequired[list[dict[Str, Any]]]
    prompt_ids: NotRequired[Ids]
    output_ids: NotRequired[Ids]
    turns: NotRequired[list[Turn]]
    shard: NotRequired[Count]
    finish_reason: NotRequired[Str]
    usage: NotRequired[dict[Str, Count]]
    quality: NotRequired[Quality]
    written: NotRequired[dict[Str, Any]]


class InputRow(TypedDict):
    """One line of an input shard (enqueue's normalised conversation)."""

    id: Str
    turns: list[list[dict[Str, Any]]]
    tools: NotRequired[list[Any] | None]


# --- commits, the run index, the manifest -------------------------------------------------

class CommitStats(TypedDict):
    samples: NotRequired[Count]
    prompt_tokens: NotRequired[Count]
    completion_tokens: NotRequired[Count]
    finish_reasons: NotRequired[dict[Str, Count]]
    rejected: NotRequired[Count]
    rejections: NotRequired[dict[Str, Count]]
    rows: NotRequired[list[tuple[Count, Count]]]


class PartStat(TypedDict):
    worker: Str
    at: Number | None
    wall_s: Number | None
    samples: Count
    rejected: Count
    tokens: Count


class Summary(TypedDict):
    """A shard's share of the run monitor's state (:mod:`common.runs.summary`)."""

    v: Int
    judged: Count
    rejected: Count
    turns: tuple[Count, Count]
    thinking_off: Count
    reasons: dict[Str, Count]
    hist: dict[Str, Count]
    groups: list[tuple[Number, Count, Count]]
    examples: dict[Str, list[tuple[Number, Count, dict[Str, Any]]]]
    answers: list[tuple[Str, Str, Number, Count]]


class GeneratedCommit(TypedDict):
    run: Str
    shard: Count
    parts: list[Str]
    sample_ids: list[Str]
    part_of: dict[Str, Str]
    stats: CommitStats
    worker: Str
    rejected_ids: NotRequired[list[Str]]
    part_stats: NotRequired[dict[Str, PartStat]]
    summary: NotRequired[Summary | dict[Str, Any]]
    committed_at: NotRequired[Number]
    schema: NotRequired[Int]


class StoredCommit(TypedDict):
    """A commit as a run-index object holds it: its identity as listed, and its bytes."""

    etag: Str
    size: Count
    body: Str


class IndexChunk(TypedDict):
    v: Int
    run: Str
    kind: Literal["commits"]
    chunk: Count
    shards: dict[Str, StoredCommit]


class Manifest(TypedDict):
    shards: Count
    rows: Count
    rejected: Count
    shard_rows: list[Count]
    examples: NotRequired[list[dict[Str, Any]]]
    layouts: NotRequired[dict[Str, dict[Str, Count]]]
    unused: NotRequired[dict[Str, dict[Str, Any]]]
    heldout: NotRequired[list[tuple[Str, Count]]]


class RunJson(TypedDict):
    """run.json as far as readers check it before :meth:`RunConfig.from_json` builds it."""

    run: Str
    model: Str
    input: Str | list[Str]
    mode: NotRequired[Literal["offline", "online"]]
    layout: NotRequired[Literal["dflash", "eagle3"]]
    shard_size: NotRequired[Annotated[StrictInt, Field(ge=1)]]
    epochs: NotRequired[Annotated[StrictInt, Field(ge=1)]]
    sampling: dict[Str, Any]
    gates: dict[Str, Any]
    target_layer_ids: NotRequired[list[Count] | None]
    drafter: NotRequired[dict[Str, Any] | None]
    schema: NotRequired[Int]


# --- quality gates, parked shards, checkpoints, hidden states -----------------------------

class PauseWindow(TypedDict):   # what window_stats writes, always all five
    size: Count
    rejected: Count
    limit: Count
    rate: Share
    max_reject_rate: Share


class GateExample(TypedDict):
    id: Str
    reasons: list[Str]
    details: NotRequired[list[Str]]
    answer: NotRequired[Str]


class PauseRecord(TypedDict):
    reason: Str
    examples: NotRequired[list[GateExample]]
    at: NotRequired[Number]
    checked: NotRequired[Count]
    rejected: NotRequired[Count]
    reasons: NotRequired[dict[Str, Count]]
    window: NotRequired[PauseWindow | None]


class BenchRowRecord(TypedDict):
    mtp: Literal["off", "on"]
    concurrency: Annotated[StrictInt, Field(ge=1)]
    output_tokens_per_s: Annotated[Number, Field(ge=0)]
    steady: NotRequired[StrictBool]   # absent (a verdict stored before): decides nothing
    window_rates: NotRequired[list[Annotated[Number, Field(ge=0)]]]
    in_flight_mean: NotRequired[Annotated[Number, Field(ge=0)]]


class BenchVerdictRecord(TypedDict):
    run: Str
    gpu: Str
    tp: Annotated[StrictInt, Field(ge=1)]
    engine: Str
    stamp: Str
    rows: list[BenchRowRecord]
    margin: NotRequired[Annotated[Number, Field(ge=0, lt=1)]]   # absent: 5%


Name = Annotated[StrictStr, Field(max_length=200)]
Level = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,6}$")]


class EvalLevel(TypedDict):
    """One concurrency of an ``eval-drafter --engine sglang`` set (:mod:`common.runs.evals`)."""

    tokens: Count
    tokens_per_s: Number
    spec_accept_length: Number | None
    baseline_tokens_per_s: Number | None
    speedup: Number | None


class EvalLossless(TypedDict):
    checked: Count
    mismatches: Annotated[list[dict[Str, Any]], Field(max_length=10_000)]


class EvalSet(TypedDict):
    """One set's row of the table ``eval-drafter --dataset --json`` prints."""

    prompts: Count
    tokens: Count | None
    tau: Number | None
    tau_pooled: Number | None
    spec_accept_length: Number | None
    by_position: Annotated[dict[Name, Number | None], Field(max_length=16)]
    lossless: EvalLossless | None
    tokens_per_s: Number | None
    speedup: Number | None
    concurrency: Annotated[dict[Level, EvalLevel], Field(max_length=64)] | None


class EvalDrafter(TypedDict):
    step: Count | None
    name: Name | None


class EvalRecord(TypedDict):
    """``eval-drafter --dataset``'s stored table: what it measured, how, and the table."""

    run: Str
    stamp: Str
    drafter: EvalDrafter
    engine: Literal["local", "sglang"]
    thinking: Name
    sets: Annotated[list[Name], Field(max_length=64)]
    max_new_tokens: Count
    datasets: Annotated[dict[Name, EvalSet], Field(max_length=64)]
    definition: dict[Str, Str]
    step: NotRequired[Count | None]
    block_size: NotRequired[Count]
    device: NotRequired[Name]
    url: NotRequired[Name | None]
    baseline_url: NotRequired[Name | None]


class ResumeRecord(TypedDict):
    accepted: StrictBool
    checked: Count
    max_reject_rate: Share
    pause_after: Annotated[StrictInt, Field(ge=1)]
    at: NotRequired[Number]
    lifted: NotRequired[Str | None]


class ParkingRecord(TypedDict):
    reason: Str
    run: NotRequired[Str]
    shard: NotRequired[Count]
    stage: NotRequired[Str]
    at: NotRequired[Number]


class LedgerRecord(TypedDict):
    epoch: Count
    done: list[Count]
    partial: NotRequired[dict[Str, Count]]
    shard_rows: NotRequired[dict[Str, Count]]
    shard_steps: NotRequired[dict[Str, Count]]
    tau_by_epoch: NotRequired[list[Number | None]]
    total_steps: NotRequired[Count]
    finished: NotRequired[Str]
    set_aside: NotRequired[dict[Str, dict[Str, Count]]]
    oom_retries: NotRequired[Count]


class CheckpointCommit(TypedDict):
    step: Count
    seq: NotRequired[Count]
    bytes: NotRequired[Count]
    ledger: LedgerRecord
    metrics: NotRequired[dict[Str, Any]]
    schema: NotRequired[Int]


class HiddenPartRecord(TypedDict):
    key: Str
    sample_ids: list[Str]
    turns: list[Count]
    tokens: list[Count]
    bytes: Count


class HiddenIndexRecord(TypedDict):
    run: Str
    shard: Count
    layout: Str
    layer_ids: list[Count]
    hidden_size: Annotated[StrictInt, Field(ge=1)]
    num_layers: Annotated[StrictInt, Field(ge=1)]
    dtype: Str
    model: Str
    parts: list[HiddenPartRecord]
    format: NotRequired[Str]
    schema: NotRequired[Int]


# --- values in Redis (any role with Redis access may write them) -------------------------

class EngineRecord(TypedDict):
    """An engine server a worker announced (:func:`common.queue.redis_keys.redis_engines`)."""

    url: Str
    log: NotRequired[Str | None]
    pid: NotRequired[Int | None]
    worker: NotRequired[Str | None]
    algorithm: NotRequired[Str | None]


GENERATED_COMMIT = TypeAdapter(GeneratedCommit)
SAMPLE = TypeAdapter(Sample)
INPUT_ROW = TypeAdapter(InputRow)
INDEX_CHUNK = TypeAdapter(IndexChunk)
MANIFEST = TypeAdapter(Manifest)
RUN_JSON = TypeAdapter(RunJson)
PAUSE = TypeAdapter(PauseRecord)
GATE_EXAMPLE = TypeAdapter(GateExample)
RESUME = TypeAdapter(ResumeRecord)
PARKING = TypeAdapter(ParkingRecord)
CHECKPOINT_COMMIT = TypeAdapter(CheckpointCommit)
HIDDEN_INDEX = TypeAdapter(HiddenIndexRecord)
BENCH_VERDICT = TypeAdapter(BenchVerdictRecord)
EVAL_RECORD = TypeAdapter(EvalRecord)
ENGINE = TypeAdapter(EngineRecord)
METRIC_LIST = TypeAdapter(list[Number | None])   # per slot or position; null: not measured

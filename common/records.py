"""Record types: the frozen run config, task payloads, shard commits, statuses and codecs."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

import orjson
import zstandard

from common.epochs import RECIPE_EPOCHS
from common.errors import RunConfigMismatch
from common.gates import GateConfig
from common.splits import HELDOUT_FRACTION, HELDOUT_MIN
from common.thinking import describe, thinking_for

CODE_VERSION = "0.1.0"


class RunState(StrEnum):
    ENQUEUING = "enqueuing"
    PENDING = "pending"
    RUNNING = "running"
    STALLED = "stalled"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"


class TaskOutcome(StrEnum):
    COMMITTED = "committed"
    ALREADY_COMMITTED = "already-committed"
    PARKED = "parked"
    PAUSED = "paused"
    LOST = "lost"  # another worker took the lease over and finishes the shard


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters sent to the engine with every request, and the thinking mode.

    ``thinking`` off renders every conversation with thinking off; on, a stable share
    ``thinking_off_share`` of them, chosen by id (``--thinking mix:R``), renders with it off.
    """

    max_new_tokens: int = 2048
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    thinking: bool = True
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    thinking_off_share: float = 0.0

    def thinking_for(self, sample_id: str) -> bool:
        """Whether conversation ``sample_id`` renders with thinking on (:mod:`common.thinking`)."""
        return thinking_for(self.thinking, self.thinking_off_share, sample_id)

    @property
    def thinking_mode(self) -> str:
        """``on``, ``off`` or ``mix:R``, as ``--thinking`` takes it."""
        return describe(self.thinking, self.thinking_off_share)


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides a run's output; written once to ``run.json`` and then frozen."""

    run: str
    model: str
    input: str | list[str]  # one input, or several (each a file, directory, glob or s3:// URL)
    format: str
    prompt_field: str | None
    shard_size: int
    limit: int | None
    sampling: Sampling = Sampling()
    gates: GateConfig = GateConfig()
    mode: str = "offline"  # offline: hidden-state workers store features; online: train queue
    layout: str = "dflash"  # target layers kept for the drafter: dflash (K layers) or eagle3
    target_layers: int = 5  # K: how many target layers feed the drafter
    # The dflash layout's layer ids as ``--target-layers`` resolved them for the model; None in
    # run.json files written before the option took names and lists (then: the spread of K).
    target_layer_ids: list[int] | None = None
    chat_template_sha: str | None = None
    prompt_template: str | None = None  # a format string over the row's fields, or detection
    strict_fields: bool = False  # reject rows with text no prompt uses, instead of reporting it
    # Options every render passes to the chat template (--chat-template-kwargs), e.g.
    # {"preserve_thinking": true}; thinking itself is sampling.thinking.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Where each sampling value came from: flag, generation_config.json or default.
    sampling_sources: dict[str, str] = field(default_factory=dict)
    heldout_fraction: float = HELDOUT_FRACTION  # never trained on: what eval-drafter decodes
    heldout_min: int = HELDOUT_MIN
    # The drafter's passes over the run's training rows (the schedule's length follows), and
    # how many end-of-epoch evaluations without a better held-out tau stop it early (None: never).
    epochs: int = RECIPE_EPOCHS
    patience: int | None = None
    # Where the drafter's shape (and starting weights) come from: enqueue's --drafter-config or
    # --init-drafter, frozen with its name, digest and content (common.drafter_origin); None:
    # the target alone shapes it (or a train worker's own option, for runs from before).
    drafter: dict[str, Any] | None = None
    code_version: str = CODE_VERSION
    created_at: float = field(default_factory=time.time)

    # Fields that record when/with what the run was made rather than what it produces.
    _INFORMATIONAL = ("code_version", "created_at")
    # The drafter's files are named by digest; where they were read from only records it.
    _INFORMATIONAL_PREFIXES = ("sampling_sources.", "drafter.path")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["sampling"] = Sampling(**data.get("sampling", {}))
        values["gates"] = GateConfig.from_json(data.get("gates"))
        return cls(**values)

    def differences(self, other: RunConfig) -> list[str]:
        """Names of the fields (``sampling.x`` for sampling) whose values differ."""
        mine, theirs = _flatten(self.to_json()), _flatten(other.to_json())
        if None in (self.target_layer_ids, other.target_layer_ids):
            # A run.json from before the field: its layers are the spread of target_layers.
            mine.pop("target_layer_ids", None)
            theirs.pop("target_layer_ids", None)
        return sorted(
            name
            for name in mine.keys() | theirs.keys()
            if name not in self._INFORMATIONAL and mine.get(name) != theirs.get(name)
            and not name.startswith(self._INFORMATIONAL_PREFIXES)
        )

    def check_same(self, other: RunConfig) -> None:
        """Raise :class:`RunConfigMismatch` naming every field that differs from ``other``."""
        diff = self.differences(other)
        if diff:
            mine, theirs = _flatten(self.to_json()), _flatten(other.to_json())
            detail = "; ".join(f"{k}: run.json has {mine.get(k)!r}, now {theirs.get(k)!r}"
                               for k in diff)
            raise RunConfigMismatch(
                f"run {self.run!r} already exists with a different configuration ({detail}); "
                "use a new --run id or the original options"
            )


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass(frozen=True)
class ShardTask:
    """The payload of a ``generate`` (and later ``hidden``/``train``) task: ids only."""

    run: str
    shard: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardTask:
        return cls(run=str(data["run"]), shard=int(data["shard"]))


@dataclass(frozen=True)
class InputManifest:
    """Written after the last input shard: how enqueue split and judged the input."""

    shards: int
    rows: int
    rejected: int
    shard_rows: list[int]
    examples: list[dict[str, Any]] = field(default_factory=list)
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)  # file -> layout -> rows
    unused: dict[str, dict[str, Any]] = field(default_factory=dict)  # field -> rows, example
    heldout: list[list[Any]] = field(default_factory=list)  # [[sample id, input shard], ...]

    @property
    def heldout_ids(self) -> frozenset[str]:
        return frozenset(str(pair[0]) for pair in self.heldout)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputManifest:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class ShardCommit:
    """``_COMMIT.json``: the canonical samples of a shard and where they live.

    ``sample_ids`` are the samples that passed the gates (the only ones handed downstream);
    ``rejected_ids`` failed a gate and live under ``rejected/`` with their reasons.
    ``part_stats``: per part key, its worker, write time, wall time, samples, rejections and
    tokens (:mod:`common.partstats`; empty in commits written before it existed).
    ``summary``: what the run monitor counts of the shard (:mod:`common.run_summary`; empty in
    older commits, whose parts are read instead).
    """

    run: str
    shard: int
    parts: list[str]
    sample_ids: list[str]
    part_of: dict[str, str]
    stats: dict[str, Any]
    worker: str
    rejected_ids: list[str] = field(default_factory=list)
    part_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    committed_at: float = field(default_factory=time.time)

    @property
    def samples(self) -> int:
        """Samples of the shard that went through generation (accepted or rejected)."""
        return len(self.sample_ids) + len(self.rejected_ids)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardCommit:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes for objects written to storage."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, indent=1).encode()


def encode_jsonl_zst(records: Iterable[dict[str, Any]]) -> bytes:
    """One JSON object per line, zstd-compressed (``.jsonl.zst``)."""
    buf = io.BytesIO()
    for record in records:
        buf.write(_line(record))
        buf.write(b"\n")
    return zstandard.ZstdCompressor(level=3).compress(buf.getvalue())


def _line(record: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(record)
    except orjson.JSONEncodeError:
        # orjson refuses what UTF-8 cannot hold (lone surrogates from JSON escapes in user
        # input) and non-string keys; the standard encoder escapes them instead.
        return json.dumps(record, separators=(",", ":")).encode()


def decode_jsonl_zst(data: bytes) -> list[dict[str, Any]]:
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return [_parse(line) for line in raw.splitlines() if line.strip()]


def _parse(line: bytes) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)  # lone surrogates written by the fallback encoder above

"""Record types: the frozen run config, task payloads, shard commits, statuses and codecs."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson
import zstandard

from common.drafter.layers import DEFAULT_K
from common.drafter.origin import DrafterOrigin
from common.engine.sampling import Sampling
from common.errors import MalformedName, RunConfigMismatch
from common.gates.judge import GateConfig
from common.key_layout import valid_run_id
from common.runs.options import FrozenOptions
from common.runs.schema import COMMIT_SCHEMA, RUN_SCHEMA, check_schema

CODE_VERSION = "0.1.0"


@dataclass(frozen=True, kw_only=True)
class RunConfig(FrozenOptions):
    """Everything that decides a run's output; written once to ``run.json`` and then frozen.

    The options frozen as given (run, format, shard size, mode, layout, epochs, ...) are the
    declared run options' own fields (:class:`common.runs.options.FrozenOptions`); the fields
    below are what enqueue resolves against the target.
    """

    model: str
    input: str | list[str]  # one input, or several (each a file, directory, glob or s3:// URL)
    sampling: Sampling = Sampling()
    gates: GateConfig = GateConfig()
    target_layers: int = DEFAULT_K  # K: how many target layers feed the drafter
    # The dflash layout's layer ids as ``--target-layers`` resolved them for the model (None:
    # eagle3, whose layers are fixed).
    target_layer_ids: list[int] | None = None
    chat_template_sha: str | None = None
    # Options every render passes to the chat template (--chat-template-kwargs), e.g.
    # {"preserve_thinking": true}; thinking itself is sampling.thinking.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Where each sampling value came from: flag, generation_config.json or default.
    sampling_sources: dict[str, str] = field(default_factory=dict)
    # Where the drafter's shape (and starting weights) come from, frozen with its name, digest
    # and content (common.drafter.origin); None only for the eagle3 layout.
    drafter: DrafterOrigin | None = None
    schema: int = RUN_SCHEMA
    code_version: str = CODE_VERSION
    created_at: float = field(default_factory=time.time)

    # Fields that record when/with what the run was made rather than what it produces.
    _INFORMATIONAL = ("code_version", "created_at")
    # The drafter's files are named by digest; where they were read from only records it.
    _INFORMATIONAL_PREFIXES = ("sampling_sources.", "drafter.path")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["drafter"] = self.drafter.to_json() if self.drafter else None
        return data

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunConfig:
        check_schema(f"runs/{data.get('run')}/run.json", data, RUN_SCHEMA)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["sampling"] = Sampling(**data["sampling"])
        values["gates"] = GateConfig.from_json(data["gates"])
        values["drafter"] = DrafterOrigin.from_json(data["drafter"]) if data.get(
            "drafter") else None
        return cls(**values)

    def differences(self, other: RunConfig) -> list[str]:
        """Names of the fields (``sampling.x`` for sampling) whose values differ."""
        mine, theirs = _flatten(self.to_json()), _flatten(other.to_json())
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
    def from_json(cls, data: Any) -> ShardTask:
        """The payload as a task; :class:`MalformedName` for anything that is not one (a run id
        outside the safe alphabet, a shard that is not a non-negative integer)."""
        run = data.get("run") if isinstance(data, dict) else None
        shard = data.get("shard") if isinstance(data, dict) else None
        if not isinstance(run, str) or not valid_run_id(run):
            raise MalformedName(f"task payload names no valid run id: {str(run)[:80]!r}")
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
            raise MalformedName(f"task payload names no shard number: {str(shard)[:80]!r}")
        return cls(run=run, shard=shard)


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
    tokens (:mod:`common.gates.partstats`).
    ``summary``: what the run monitor counts of the shard (:mod:`common.runs.summary`).
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
    schema: int = COMMIT_SCHEMA

    @property
    def samples(self) -> int:
        """Samples of the shard that went through generation (accepted or rejected)."""
        return len(self.sample_ids) + len(self.rejected_ids)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardCommit:
        check_schema(f"runs/{data.get('run')}/generated/shard {data.get('shard')} commit", data,
                     COMMIT_SCHEMA)
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

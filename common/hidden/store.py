"""Hidden-state shards in storage: safetensors parts, a per-shard index, the commit, a reader.

Writing (the hidden task, after the generated shard's commit; the writer in
:mod:`common.hidden.writer`)::

    index = read_hidden_index(storage, run, shard)       # a finished earlier attempt wins
    if index is None:
        writer = HiddenShardWriter(storage, run, shard, extractor.meta)
        for batch in batches:
            writer.add(extractor.extract(batch))
        index = writer.finish()                           # parts, then index.json (put-once)
    write_hidden_commit(storage, run, shard, index)       # last; an existing commit wins

Reading (offline training)::

    for record in iter_hidden_records(storage, run):
        record["hidden_states"]                           # bf16 [T, K*H]

A part holds many records concatenated on the token axis: ``input_ids`` int32 [N], ``loss_mask``
uint8 [N], ``hidden_states`` [N, K*H], ``last_hidden_states`` [N, H] (EAGLE-3 only) and
``offsets`` int64 [R+1] (record i is rows ``offsets[i]:offsets[i+1]``); its sample ids and turns
are in the safetensors metadata and in the index. Only parts listed by a ``_COMMIT.json`` are
ever read, so parts left by a killed attempt are harmless.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common import keys
from common.choices import Layout
from common.errors import ForeignObject, HiddenStateError, NotFound
from common.reads import note, parse_json, read_json
from common.runs.records import dumps
from common.runs.schema import COMMIT_SCHEMA, check_schema
from common.runs.schemas import HIDDEN_INDEX
from common.storage import Storage

log = logging.getLogger(__name__)

FORMAT = "dflash-hidden/1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_PART_BYTES = 512 * 2**20


@dataclass(frozen=True)
class HiddenMeta:
    """What a shard's hidden states are: layout, target layers and feature width."""

    layout: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    num_layers: int
    model: str = ""

    @property
    def width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def has_last(self) -> bool:
        """EAGLE-3 keeps the last layer's state (HF ``hidden_states[-1]``) separately."""
        return self.layout == Layout.EAGLE3


@dataclass(frozen=True)
class HiddenRecord:
    """One training row's target features, sliced to its real length T."""

    sample_id: str
    turn: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    last_hidden_states: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class HiddenPart:
    """One safetensors part: its key and the records it holds, in order."""

    key: str
    sample_ids: list[str]
    turns: list[int]
    tokens: list[int]
    bytes: int


@dataclass(frozen=True)
class HiddenIndex:
    """``index.json`` of a shard (and the body of its ``_COMMIT.json``)."""

    run: str
    shard: int
    layout: str
    layer_ids: list[int]
    hidden_size: int
    num_layers: int
    dtype: str
    model: str
    parts: list[HiddenPart] = field(default_factory=list)
    format: str = FORMAT
    schema: int = COMMIT_SCHEMA

    @property
    def records(self) -> int:
        return sum(len(p.sample_ids) for p in self.parts)

    @property
    def tokens(self) -> int:
        return sum(sum(p.tokens) for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "records": self.records, "tokens": self.tokens}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HiddenIndex:
        check_schema(f"runs/{data.get('run')}/hidden/shard {data.get('shard')} index", data,
                     COMMIT_SCHEMA)
        # The fields a part and an index have, no others (a record's schema lets extra ones
        # through: a key naming none of ours is no TypeError here).
        parts = [HiddenPart(**{n: p[n] for n in PART_FIELDS}) for p in data["parts"]]
        names = ("run", "shard", "layout", "layer_ids", "hidden_size", "num_layers", "dtype",
                 "model", "schema")
        return cls(**{n: data[n] for n in names}, parts=parts,
                   format=data.get("format", FORMAT))


def check_record(record: HiddenRecord, meta: HiddenMeta, finite: bool = True) -> None:
    """Raise :class:`HiddenStateError` unless the record's shapes (and values) are usable."""
    where = f"record {record.sample_id!r} turn {record.turn}"
    t = record.tokens
    if record.input_ids.dim() != 1 or t == 0:
        raise HiddenStateError(f"{where}: input_ids must be a non-empty 1-D tensor")
    expected = {"loss_mask": (t,), "hidden_states": (t, meta.width)}
    if meta.has_last:
        expected["last_hidden_states"] = (t, meta.hidden_size)
    elif record.last_hidden_states is not None:
        raise HiddenStateError(f"{where}: last_hidden_states given for layout {meta.layout}")
    for name, shape in expected.items():
        tensor = getattr(record, name)
        if tensor is None or tuple(tensor.shape) != shape:
            got = None if tensor is None else tuple(tensor.shape)
            raise HiddenStateError(f"{where}: {name} has shape {got}, expected {shape}")
    if finite:
        for name in ("hidden_states", "last_hidden_states"):
            tensor = getattr(record, name)
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                raise HiddenStateError(f"{where}: {name} contains NaN or Inf")


def encode_part(records: list[HiddenRecord], meta: HiddenMeta, dtype: str = "bf16") -> bytes:
    """Concatenate records on the token axis into one safetensors blob."""
    lengths = [r.tokens for r in records]
    offsets = torch.zeros(len(records) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "input_ids": torch.cat([r.input_ids.to(torch.int32) for r in records]),
        "loss_mask": torch.cat([r.loss_mask.to(torch.uint8) for r in records]),
        "hidden_states": torch.cat([r.hidden_states.to(DTYPES[dtype]) for r in records]),
        "offsets": offsets,
    }
    if meta.has_last:
        lasts = [r.last_hidden_states for r in records]
        if any(last is None for last in lasts):
            raise ValueError("a layout that keeps the last state has a record without it")
        tensors["last_hidden_states"] = torch.cat(
            [last.to(DTYPES[dtype]) for last in lasts if last is not None])
    metadata = {
        "format": FORMAT, "layout": meta.layout, "layer_ids": json.dumps(list(meta.layer_ids)),
        "hidden_size": str(meta.hidden_size), "dtype": dtype,
        "sample_ids": json.dumps([r.sample_id for r in records]),
        "turns": json.dumps([r.turn for r in records]),
    }
    return st_save(tensors, metadata=metadata)


def decode_part(data: bytes, key: str = "a hidden-state part"
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A part's tensors and its safetensors metadata (the header parsed as stored JSON is)."""
    size = int.from_bytes(data[:8], "little")
    metadata = parse_json(key, data[8 : 8 + size]).get("__metadata__", {})
    return st_load(data), metadata


PART_FIELDS = tuple(f.name for f in fields(HiddenPart))


def _read_index(storage: Storage, key: str) -> HiddenIndex | None:
    """An ``index.json`` or hidden ``_COMMIT.json``: bounded, typed (:class:`ForeignObject`,
    noted, where the object is not one); None where it is not there."""
    try:
        data = read_json(storage, key, HIDDEN_INDEX)
    except NotFound:
        return None
    except ForeignObject as exc:
        note(exc)
        raise
    return HiddenIndex.from_json(dict(data))


def read_hidden_index(storage: Storage, run: str, shard: int) -> HiddenIndex | None:
    """The shard's ``index.json``, or None before an attempt finished writing parts."""
    return _read_index(storage, keys.hidden_index(run, shard))


def read_hidden_commit(storage: Storage, run: str, shard: int) -> HiddenIndex | None:
    """The index recorded in the shard's ``_COMMIT.json``, or None if not committed."""
    return _read_index(storage, keys.hidden_commit(run, shard))


def write_hidden_commit(storage: Storage, run: str, shard: int, index: HiddenIndex,
                        worker: str = "") -> HiddenIndex:
    """Write the shard's commit (parts + record ids) once; returns the commit that stands."""
    if (index.run, index.shard) != (run, shard):
        raise HiddenStateError(f"index of {index.run}/{index.shard} given for {run}/{shard}")
    body = {**index.to_json(), "committed_at": time.time(), "worker": worker}
    if storage.put_once(keys.hidden_commit(run, shard), dumps(body)):
        return index
    log.info("run %s shard %d: hidden states already committed", run, shard)
    existing = read_hidden_commit(storage, run, shard)
    assert existing is not None  # put_once said it exists
    return existing


def committed_hidden_shards(storage: Storage, run: str) -> list[int]:
    """Shard numbers that have a hidden-state ``_COMMIT.json``."""
    from common.runs.store import RunStore

    return sorted(RunStore(storage, run).committed("hidden"))


def iter_hidden_records(storage: Storage, run: str,
                        shards: Iterable[int] | None = None) -> Iterator[dict[str, Any]]:
    """Every committed record as a dict of tensors (views into its part), shard by shard."""
    chosen = committed_hidden_shards(storage, run) if shards is None else sorted(set(shards))
    for shard in chosen:
        index = read_hidden_commit(storage, run, shard)
        if index is None:
            log.info("run %s shard %d: no hidden-state commit, skipped", run, shard)
            continue
        for part in index.parts:
            yield from _part_records(storage, shard, part)


def _part_records(storage: Storage, shard: int, part: HiddenPart) -> Iterator[dict[str, Any]]:
    data = storage.get(part.key, limit=part.bytes)   # never more than its commit says it holds
    if len(data) != part.bytes:
        raise HiddenStateError(f"{part.key}: {len(data):,} bytes where the shard's commit says "
                               f"{part.bytes:,}")
    try:
        tensors, metadata = decode_part(data, part.key)
        ids = parse_json(part.key, metadata["sample_ids"])
        turns = parse_json(part.key, metadata["turns"])
        offsets = tensors["offsets"].tolist()
    except (ForeignObject, ValueError, KeyError, TypeError, AttributeError, SafetensorError,
            RecursionError) as exc:   # UnicodeDecodeError is a ValueError
        raise HiddenStateError(f"{part.key}: not a hidden-state part ({exc})") from None
    if ids != part.sample_ids or turns != part.turns or len(offsets) != len(ids) + 1 \
            or not all(isinstance(o, int) for o in offsets) or offsets != sorted(offsets):
        raise HiddenStateError(f"{part.key}: records differ from the shard's commit")
    last = tensors.get("last_hidden_states")
    for i, (sample_id, turn) in enumerate(zip(ids, turns, strict=True)):
        lo, hi = offsets[i], offsets[i + 1]
        record = {"sample_id": sample_id, "turn": turn, "shard": shard,
                  "input_ids": tensors["input_ids"][lo:hi],
                  "loss_mask": tensors["loss_mask"][lo:hi],
                  "hidden_states": tensors["hidden_states"][lo:hi]}
        if last is not None:
            record["last_hidden_states"] = last[lo:hi]
        yield record

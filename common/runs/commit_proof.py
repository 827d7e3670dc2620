"""A shard's commit proven against its run before any reader counts it: one check for all.

    bounds = run_bounds(storage, run)              # the manifest's shards and rows (cached)
    prove_commit(key, commit, bounds)              # a generate commit: ForeignObject unless ...
    prove_hidden_commit(key, commit, bounds)       # a hidden commit, the same way

Any role's key may write a commit of its stage for any shard of any run, so a schema-valid
``_COMMIT.json`` proves nothing by itself. A commit counts only where its ``run`` and ``shard``
are its key's, the shard is within the manifest's total (before the manifest: no bound), its
sample ids are unique and no more than that shard's input rows, and every part it names is a
part of that same shard of that same run (generate: its ``generated`` or ``rejected`` parts,
accepted ids in the first, rejected ids in the second; hidden: its ``.safetensors`` parts).
Anything else is :class:`ForeignObject`: its reader notes it once and leaves the commit out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from common import keys
from common.errors import ForeignObject, NotFound, SchemaMismatch, StorageRefused
from common.reads import note, read_record
from common.runs.records import InputManifest
from common.runs.schema import COMMIT_SCHEMA, check_schema
from common.runs.schemas import MANIFEST
from common.storage import Storage

log = logging.getLogger(__name__)

ABSENT_FOR_S = 2.0   # a manifest not there yet is asked again after this long (it is final)
KEPT_AT_MOST = 4096  # runs whose bounds a process keeps (a flood of run ids stays bounded)
PARTS_OF = {"generated": ("generated", "rejected"), "hidden": ("hidden",)}


@dataclass(frozen=True)
class Bounds:
    """What a run's manifest allows: its shards and each shard's input rows (None: no bound)."""

    shards: int | None = None
    shard_rows: tuple[int, ...] = ()

    def rows(self, shard: int) -> int | None:
        """Samples the shard can hold at most (one per input row), None before the manifest."""
        if self.shards is None or shard >= len(self.shard_rows):
            return None
        return self.shard_rows[shard]


NO_BOUNDS = Bounds()
_lock = threading.Lock()
_known: dict[tuple[str, str], Bounds] = {}
_absent: dict[tuple[str, str], float] = {}


def run_bounds(storage: Storage, run: str) -> Bounds:
    """The run's bounds from its manifest (put-once: read once per process); none before it
    exists, or where it is foreign (noted) or unreadable to this key."""
    where = (storage.root, run)
    with _lock:
        if where in _known:
            return _known[where]
        if time.monotonic() - _absent.get(where, -ABSENT_FOR_S) < ABSENT_FOR_S:
            return NO_BOUNDS
    try:
        manifest = InputManifest.from_json(read_record(storage, keys.inputs_manifest(run),
                                                       MANIFEST))
    except (NotFound, StorageRefused):
        manifest = None
    except ForeignObject as exc:
        note(exc)
        manifest = None
    with _lock:
        if len(_known) + len(_absent) >= KEPT_AT_MOST:
            _known.clear()
            _absent.clear()
        if manifest is None:
            _absent[where] = time.monotonic()
            return NO_BOUNDS
        found = _known[where] = Bounds(manifest.shards, tuple(manifest.shard_rows))
    log.debug("run %s: commits proven against %d shards", run, manifest.shards)
    return found


def forget_bounds() -> None:
    """Read every run's manifest afresh (tests; a run id deleted and made again)."""
    with _lock:
        _known.clear()
        _absent.clear()


def commit_key(key: str, area: str) -> tuple[str, int]:
    """The run and shard of a commit key of ``area`` (generated, hidden)."""
    found = keys.parse(key)
    if found is None or found.kind is not keys.KeyKind.COMMIT or found.area != area \
            or found.shard is None:
        raise ForeignObject(key, f"not a {area} commit's key")
    return found.run, found.shard


def _of_run(key: str, commit: Mapping[str, Any], area: str, bounds: Bounds) -> tuple[str, int]:
    """The key's run and shard, once the commit names them and the shard is within bounds."""
    run, shard = commit_key(key, area)
    if commit["run"] != run or commit["shard"] != shard:
        raise ForeignObject(key, f"it names run {str(commit['run'])[:80]!r} shard "
                                 f"{commit['shard']}")
    if bounds.shards is not None and shard >= bounds.shards:
        raise ForeignObject(key, f"shard {shard} is past the run's {bounds.shards} shards")
    return run, shard


def _areas(key: str, run: str, shard: int, parts: Iterable[str],
           allowed: tuple[str, ...]) -> dict[str, str]:
    """Each part key's area, once every one is a part of this shard of this run."""
    areas = {}
    for part in set(parts):
        found = keys.parse(part)
        if found is None or found.kind is not keys.KeyKind.PART or found.run != run \
                or found.shard != shard or found.area not in allowed:
            raise ForeignObject(key, f"it names {part[:120]!r}, no part of its shard")
        areas[part] = found.area
    return areas


def _counted(key: str, ids: list[Any], rows: int | None) -> None:
    """Unique ids, no more than the shard's input rows."""
    if len(set(ids)) != len(ids):
        raise ForeignObject(key, "it names a sample twice")
    if rows is not None and len(ids) > rows:
        raise ForeignObject(key, f"it names {len(ids)} samples; its shard has {rows} rows")


def prove_commit(key: str, commit: Mapping[str, Any], bounds: Bounds) -> None:
    """Raise :class:`ForeignObject` unless the (schema-valid) generate commit at ``key`` is one
    its shard could have: see the module docstring."""
    run, shard = _of_run(key, commit, "generated", bounds)
    accepted, rejected = commit["sample_ids"], commit.get("rejected_ids", [])
    _counted(key, [*accepted, *rejected], bounds.rows(shard))
    part_of = commit["part_of"]
    areas = _areas(key, run, shard, [*commit["parts"], *part_of.values()],
                   PARTS_OF["generated"])
    for ids, area in ((accepted, "generated"), (rejected, "rejected")):
        if any(areas[part_of[i]] != area for i in ids if i in part_of):
            raise ForeignObject(key, f"it names a part outside {area}/ for one of its "
                                     f"{area} samples")
    if len(part_of) > len(accepted) + len(rejected) \
            or not set(part_of).issubset({*accepted, *rejected}):
        raise ForeignObject(key, "its part_of names samples it does not commit")


def prove_hidden_commit(key: str, commit: Mapping[str, Any], bounds: Bounds) -> None:
    """Raise :class:`ForeignObject` unless the hidden commit at ``key`` (schema-valid as a
    hidden index) is one its shard could have: its parts its shard's, each part's records
    (sample id, turn, tokens) in step, no record twice, no more samples than the shard's rows."""
    run, shard = _of_run(key, commit, "hidden", bounds)
    try:
        check_schema(key, commit, COMMIT_SCHEMA)
    except SchemaMismatch as exc:
        raise ForeignObject(key, str(exc)) from None
    parts = commit["parts"]
    _areas(key, run, shard, [p["key"] for p in parts], PARTS_OF["hidden"])
    if len({p["key"] for p in parts}) != len(parts):
        raise ForeignObject(key, "it names a part twice")
    records: list[tuple[Any, Any]] = []
    for part in parts:
        if not len(part["sample_ids"]) == len(part["turns"]) == len(part["tokens"]):
            raise ForeignObject(key, f"part {part['key'][-40:]!r}: its records' ids, turns and "
                                     "tokens differ in number")
        records += zip(part["sample_ids"], part["turns"], strict=True)
    if len(set(records)) != len(records):
        raise ForeignObject(key, "it names a record twice")
    _counted(key, sorted({sample for sample, _ in records}), bounds.rows(shard))

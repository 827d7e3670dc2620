"""Keys read back from a listing, parsed by their exact layout: the inverse of :mod:`common.keys`.

A key is what the pipeline wrote only if it is exactly what a template of :mod:`common.keys`
writes (run id, area, digits and all): ``runs/R/drafter/index/step-000999/_COMMIT.json`` or
``runs/R/generated/shard-000001/drafter/_COMMIT.json`` (both writable by a key whose grant's
``*`` crosses a ``/``) is no checkpoint and no commit. Anything else is ignored, logged once per
key, and never taken for a step, a part or a commit; :mod:`common.keys` re-exports these.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Iterable
from typing import NamedTuple

log = logging.getLogger(__name__)

SHARD_DIGITS = 6
PART_DIGITS = 4
STEP_DIGITS = 6
INDEX_CHUNK = 100
"""Shards per run-index object: a decimal prefix of their names (``shard-0012`` holds 1200-1299)."""
ACCESS_PROBE_RUN = "_access"   # never a run id (valid_run_id): the probe touches no run
IGNORED_LOGGED = 10_000   # foreign keys logged per process at most (a flood stays bounded)

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)


def valid_run_id(run: str) -> bool:
    """Run ids become key prefixes, so keep them to a safe, portable alphabet (the whole id:
    no trailing newline, no other script's digits)."""
    return isinstance(run, str) and bool(_RUN_ID.fullmatch(run)) and ".." not in run


class KeyKind(enum.StrEnum):
    """What an object of the storage layout is (:func:`parse`)."""

    RUN_CONFIG = "run.json"
    INPUT = "input shard"
    MANIFEST = "inputs manifest"
    INPUT_ROWS = "rejected input rows"
    PART = "part"
    COMMIT = "commit"
    HIDDEN_INDEX = "hidden index"
    FAILED = "parking record"
    GATE = "gate event"
    REPORT = "report"
    CHECKPOINT = "checkpoint file"
    LATEST = "latest checkpoint pointer"
    INDEX = "run-index object"
    PROBE = "access probe"
    BENCH = "bench verdict"
    EVAL = "eval record"


class Key(NamedTuple):
    """A listed key as the layout reads it. ``area``: a shard's (generated, rejected, hidden),
    a parking record's stage; ``number``: a part's, a step's, an index object's chunk; ``seq``: a
    checkpoint's sequence, an index object's count; ``name``: a checkpoint's file, an index
    object's kind, a gate event's kind, a probe's area; a bench verdict's ``area``: what decides
    it (the GPU model, TP and engine arguments, :mod:`common.runs.bench_verdict`)."""

    kind: KeyKind
    run: str
    area: str = ""
    shard: int | None = None
    number: int | None = None
    seq: int = 0
    name: str = ""


_R, _S, _STAMP = r"runs/(?P<run>[^/]+)/", r"shard-(?P<shard>\d+)", r"[A-Za-z0-9._-]+"
_LAYOUTS = (  # (kind, exact layout, digits of ``number``): every key the templates above write
    (KeyKind.PART, rf"{_R}(?P<area>generated|rejected)/{_S}/part-(?P<number>\d+)\.jsonl\.zst",
     PART_DIGITS),
    (KeyKind.PART, rf"{_R}(?P<area>hidden)/{_S}/part-(?P<number>\d+)\.safetensors", PART_DIGITS),
    (KeyKind.COMMIT, rf"{_R}(?P<area>generated|hidden)/{_S}/_COMMIT\.json", 0),
    (KeyKind.HIDDEN_INDEX, rf"{_R}(?P<area>hidden)/{_S}/index\.json", 0),
    (KeyKind.CHECKPOINT, rf"{_R}drafter/step-(?P<number>\d+)(?:\.(?P<seq>[1-9]\d*))?/"
                         r"(?P<name>state\.pt|_COMMIT\.json)", STEP_DIGITS),
    (KeyKind.LATEST, rf"{_R}drafter/latest\.json", 0),
    (KeyKind.INDEX, rf"{_R}index/(?P<name>commits|digests|summaries)/chunk-(?P<number>\d+)-"
                    r"(?P<count>\d+)-[0-9a-f]{8}\.json\.zst", 4),
    (KeyKind.INPUT, rf"{_R}inputs/{_S}\.jsonl\.zst", 0),
    (KeyKind.MANIFEST, rf"{_R}inputs/_MANIFEST\.json", 0),
    (KeyKind.INPUT_ROWS, rf"{_R}rejected/input/rows-(?P<number>\d+)\.jsonl", PART_DIGITS),
    (KeyKind.FAILED, rf"{_R}failed/(?:(?P<area>hidden|train)/)?{_S}/{_STAMP}\.json", 0),
    (KeyKind.GATE, rf"{_R}gates/(?P<name>pause|resume)-{_STAMP}\.json", 0),
    (KeyKind.REPORT, rf"{_R}reports/report-{_STAMP}\.png", 0),
    (KeyKind.BENCH, rf"{_R}bench/(?P<area>[a-z0-9][a-z0-9.-]{{0,95}})/verdict-{_STAMP}\.json", 0),
    (KeyKind.EVAL, rf"{_R}evals/eval-{_STAMP}\.json", 0),
    (KeyKind.RUN_CONFIG, rf"{_R}run\.json", 0),
)
# ASCII: ``\d`` is 0-9 only (a checkpoint's "step-00००12" is no step).
_COMPILED = tuple((kind, re.compile(layout, re.ASCII), digits)
                  for kind, layout, digits in _LAYOUTS)
_PROBE = re.compile(rf"runs/{ACCESS_PROBE_RUN}/(?P<name>[a-z]+)/(?:_PROBE|doctor-[0-9a-f]{{32}})",
                    re.ASCII)
_IGNORED: set[str] = set()


def _canonical(digits: str | None, width: int) -> bool:
    """True when ``digits`` are exactly what ``f"{n:0{width}d}"`` writes (no stray zeros)."""
    return digits is None or digits == f"{int(digits):0{width}d}"


def parse(key: str) -> Key | None:
    """The key as the storage layout reads it: it must be exactly what a template writes (run
    id, digits and all). Any other key is ignored: None, and one warning per key."""
    for kind, layout, digits in _COMPILED:
        if (match := layout.fullmatch(key)) is not None:
            group = match.groupdict()
            if valid_run_id(group["run"]) and _canonical(group.get("shard"), SHARD_DIGITS) \
                    and _canonical(group.get("number"), digits) \
                    and _canonical(group.get("count"), 3):
                number, count = group.get("number"), group.get("seq") or group.get("count")
                area = group.get("area") or ("generate" if kind is KeyKind.FAILED else "")
                return Key(kind, group["run"], area,
                           None if group.get("shard") is None else int(group["shard"]),
                           None if number is None else int(number), int(count or 0),
                           group.get("name") or "")
            break
    else:
        if (probe := _PROBE.fullmatch(key)) is not None:
            return Key(KeyKind.PROBE, ACCESS_PROBE_RUN, name=probe["name"])
    _ignored(key)
    return None


def _ignored(key: str) -> None:
    if key in _IGNORED or len(_IGNORED) > IGNORED_LOGGED:
        return
    _IGNORED.add(key)
    run = key.split("/")[1] if key.startswith("runs/") and key.count("/") > 1 else "-"
    log.warning("run %s: ignoring storage key %s: not a key of the pipeline's layout (written "
                "by hand, or by a key with more access than its role needs)", run, key)
    if len(_IGNORED) > IGNORED_LOGGED:
        log.warning("more than %d foreign storage keys ignored: no more are logged",
                    IGNORED_LOGGED)


def _shard_kinds(key: str, *kinds: KeyKind) -> Key | None:
    found = parse(key)
    return found if found is not None and found.kind in kinds else None


def shard_of(key: str) -> int | None:
    """The shard of a part, commit, hidden index or parking record key; else None."""
    found = _shard_kinds(key, KeyKind.PART, KeyKind.COMMIT, KeyKind.HIDDEN_INDEX, KeyKind.FAILED)
    return None if found is None else found.shard


def part_number(key: str, suffix: str = ".jsonl.zst") -> int | None:
    """The part index of a part key (generated's, or hidden's ``.safetensors``), else None."""
    found = _shard_kinds(key, KeyKind.PART)
    return found.number if found is not None and key.endswith(suffix) else None


def commit_shard(key: str, area: str = "generated") -> int | None:
    """The shard whose ``_COMMIT.json`` in ``area`` (generated, hidden) ``key`` is, else None."""
    found = _shard_kinds(key, KeyKind.COMMIT)
    return found.shard if found is not None and found.area == area else None


def input_shard_of(key: str) -> int | None:
    """The shard of an input shard's key (``inputs/shard-N.jsonl.zst``), else None."""
    found = _shard_kinds(key, KeyKind.INPUT)
    return None if found is None else found.shard


def checkpoint_id(key: str) -> tuple[int, int] | None:
    """(step, seq) of a checkpoint's ``_COMMIT.json`` key, else None."""
    found = _shard_kinds(key, KeyKind.CHECKPOINT)
    if found is None or found.name != "_COMMIT.json" or found.number is None:
        return None
    return found.number, found.seq


def index_entry(key: str) -> tuple[int, int] | None:
    """(chunk, count) of a run-index object's key, else None."""
    found = _shard_kinds(key, KeyKind.INDEX)
    return None if found is None or found.number is None else (found.number, found.seq)


def file_listing(listed: Iterable[str], commits: dict[int, str],
                 parts: dict[int, list[str]]) -> None:
    """Sort listed keys of the generated/rejected areas into shard commits (generated) and part
    keys, in listing order; a key of no exact layout is neither."""
    for key in listed:
        found = parse(key)
        if found is None or found.shard is None:
            continue
        if found.kind is KeyKind.COMMIT and found.area == "generated":
            commits[found.shard] = key
        elif found.kind is KeyKind.PART:
            parts.setdefault(found.shard, []).append(key)

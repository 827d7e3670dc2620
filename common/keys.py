"""Every storage key the pipeline uses, as templates in one place (Redis keys: ``redis_keys``).

Storage keys are relative to the storage root (``s3://bucket/prefix`` or a local directory).
"""

from __future__ import annotations

import re

from common.errors import MalformedName

SHARD_DIGITS = 6
PART_DIGITS = 4

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHARD = r"shard-(\d+)"   # what shard_name writes; 6 digits grow to 7 past shard 999999
_SHARD_NAME = re.compile(_SHARD)
_SHARD_DIR = re.compile(rf"(?:^|/){_SHARD}/")
STEP_DIGITS = 6
_STEP = re.compile(r"/step-(\d{6})(?:\.(\d+))?/_COMMIT\.json$")


def valid_run_id(run: str) -> bool:
    """Run ids become key prefixes, so keep them to a safe, portable alphabet."""
    return bool(_RUN_ID.match(run)) and ".." not in run


def shard_name(shard: int) -> str:
    return f"shard-{shard:0{SHARD_DIGITS}d}"


def parse_shard_name(name: str) -> int:
    """The shard a :func:`shard_name` names (Redis fields, lease keys' last part): its inverse."""
    match = _SHARD_NAME.fullmatch(name)
    if match is None:
        raise MalformedName(f"{name!r} is not a shard name (shard-{'N' * SHARD_DIGITS})")
    return int(match.group(1))


def run_config(run: str) -> str:
    return f"runs/{run}/run.json"


def inputs_prefix(run: str) -> str:
    return f"runs/{run}/inputs/"


def input_shard(run: str, shard: int) -> str:
    return f"runs/{run}/inputs/{shard_name(shard)}.jsonl.zst"


def inputs_manifest(run: str) -> str:
    """Written after the last input shard: its presence means enqueue finished reading."""
    return f"runs/{run}/inputs/_MANIFEST.json"


def rejected_input_rows(run: str, chunk: int) -> str:
    return f"runs/{run}/rejected/input/rows-{chunk:0{PART_DIGITS}d}.jsonl"


def generated_prefix(run: str) -> str:
    return f"runs/{run}/generated/"


def generated_shard_prefix(run: str, shard: int) -> str:
    return f"runs/{run}/generated/{shard_name(shard)}/"


def generated_part(run: str, shard: int, part: int) -> str:
    return f"{generated_shard_prefix(run, shard)}part-{part:0{PART_DIGITS}d}.jsonl.zst"


def generated_commit(run: str, shard: int) -> str:
    return f"{generated_shard_prefix(run, shard)}_COMMIT.json"


def rejected_prefix(run: str) -> str:
    """Samples that failed a quality gate, in parts beside ``generated/``, with their reasons."""
    return f"runs/{run}/rejected/"


def rejected_shard_prefix(run: str, shard: int) -> str:
    return f"runs/{run}/rejected/{shard_name(shard)}/"


def rejected_part(run: str, shard: int, part: int) -> str:
    return f"{rejected_shard_prefix(run, shard)}part-{part:0{PART_DIGITS}d}.jsonl.zst"


def gates_prefix(run: str) -> str:
    """Pause and resume decisions of the run monitor, one put-once object each."""
    return f"runs/{run}/gates/"


def gate_event(run: str, kind: str, stamp: str) -> str:
    """``kind`` is ``pause`` or ``resume``; stamps sort chronologically."""
    return f"runs/{run}/gates/{kind}-{stamp}.json"


def report_png(run: str, stamp: str) -> str:
    """A report's plots; one per ``report`` call, never overwritten."""
    return f"runs/{run}/reports/report-{stamp}.png"


def drafter_prefix(run: str) -> str:
    return f"runs/{run}/drafter/"


def drafter_checkpoint(run: str, step: int, name: str, seq: int = 0) -> str:
    """A file of the drafter checkpoint at ``step`` (``state.pt``, then ``_COMMIT.json``).

    ``seq`` > 0 names a later checkpoint at the same step (only its ledger moved on).
    """
    suffix = f".{seq}" if seq else ""
    return f"runs/{run}/drafter/step-{step:0{STEP_DIGITS}d}{suffix}/{name}"


def drafter_latest(run: str) -> str:
    """Pointer to the newest committed checkpoint: the one object that is overwritten."""
    return f"runs/{run}/drafter/latest.json"


def checkpoint_id(key: str) -> tuple[int, int] | None:
    """(step, seq) of a checkpoint's ``_COMMIT.json`` key, else None."""
    match = _STEP.search(key)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def failed_shard(run: str, shard: int, stamp: str, stage: str = "generate") -> str:
    """A parked shard's reason; one object per parking so history is never overwritten."""
    where = "" if stage == "generate" else f"{stage}/"
    return f"runs/{run}/failed/{where}{shard_name(shard)}/{stamp}.json"


def part_number(key: str, suffix: str = ".jsonl.zst") -> int | None:
    """The part index of a part key (generated's, or hidden's ``.safetensors``), else None."""
    match = re.search(rf"(?:^|/)part-(\d+){re.escape(suffix)}$", key)
    return int(match.group(1)) if match else None


def shard_of(key: str) -> int | None:
    """The shard index that a key under ``generated/`` or ``failed/`` belongs to."""
    match = _SHARD_DIR.search(key)
    return int(match.group(1)) if match else None


INDEX_CHUNK = 100
"""Shards per run-index object: a decimal prefix of their names (``shard-0012`` holds 1200-1299)."""
_INDEX = re.compile(r"/chunk-(\d{4})-(\d{3})-[0-9a-f]{8}\.json\.zst$")


def chunk_stem(chunk: int) -> str:
    """The name prefix every shard of ``chunk`` shares (one LIST finds them all)."""
    return shard_name(chunk * INDEX_CHUNK)[:-2]


def generated_chunk_prefix(run: str, chunk: int) -> str:
    return f"runs/{run}/generated/{chunk_stem(chunk)}"


def rejected_chunk_prefix(run: str, chunk: int) -> str:
    return f"runs/{run}/rejected/{chunk_stem(chunk)}"


def hidden_chunk_prefix(run: str, chunk: int) -> str:
    return f"runs/{run}/hidden/{chunk_stem(chunk)}"


def index_prefix(run: str, kind: str) -> str:
    """The run index (``digests`` or ``summaries``): put-once objects derived from commits."""
    return f"runs/{run}/index/{kind}/"


def index_object(run: str, kind: str, chunk: int, count: int, tag: str) -> str:
    """``count`` commits of ``chunk``; ``tag`` names the set, so equal sets share one key."""
    return f"{index_prefix(run, kind)}chunk-{chunk:04d}-{count:03d}-{tag}.json.zst"


def index_entry(key: str) -> tuple[int, int] | None:
    """(chunk, count) of a run-index object's key, else None."""
    match = _INDEX.search(key)
    return (int(match.group(1)), int(match.group(2))) if match else None


def hidden_prefix(run: str) -> str:
    return f"runs/{run}/hidden/"


def hidden_shard_prefix(run: str, shard: int) -> str:
    return f"runs/{run}/hidden/{shard_name(shard)}/"


def hidden_part(run: str, shard: int, part: int) -> str:
    """Many records per safetensors file, concatenated on the token axis."""
    return f"{hidden_shard_prefix(run, shard)}part-{part:0{PART_DIGITS}d}.safetensors"


def hidden_index(run: str, shard: int) -> str:
    return f"{hidden_shard_prefix(run, shard)}index.json"


def hidden_commit(run: str, shard: int) -> str:
    """Written last by the hidden task: the shard's parts and record ids are final."""
    return f"{hidden_shard_prefix(run, shard)}_COMMIT.json"


ACCESS_PROBE_RUN = "_access"   # never a run id (valid_run_id): the probe touches no run


def access_probe(area: str) -> str:
    """A worker's start-up write probe in its stage's area (``generated``, ``hidden``,
    ``drafter``): written once per storage root, refused where the key may not write there."""
    return f"runs/{ACCESS_PROBE_RUN}/{area}/_PROBE"

"""Every storage key the pipeline uses, as templates in one place (Redis keys: ``redis_keys``).

Storage keys are relative to the storage root (``s3://bucket/prefix`` or a local directory).
A key read back from a listing is parsed by its exact layout (:func:`parse`): anything else is
ignored, logged once, and never taken for a step, a part or a commit (another stage's key may
be able to write it: ``docs/guides/least-privilege.md``).
"""

from __future__ import annotations

import re

from common.choices import GateEvent, Stage
from common.errors import MalformedName
from common.key_layout import (  # the parsers of listed keys: the templates' inverse
    ACCESS_PROBE_RUN,
    INDEX_CHUNK,
    PART_DIGITS,
    SHARD_DIGITS,
    STEP_DIGITS,
    Key,
    KeyKind,
    checkpoint_id,
    commit_shard,
    index_entry,
    input_shard_of,
    parse,
    part_number,
    shard_of,
    valid_run_id,
)

__all__ = ["ACCESS_PROBE_RUN", "INDEX_CHUNK", "PART_DIGITS", "SHARD_DIGITS", "STEP_DIGITS", "Key",
           "KeyKind", "checkpoint_id", "commit_shard", "index_entry", "input_shard_of", "parse",
           "part_number", "shard_of", "valid_run_id"]

_SHARD_NAME = re.compile(r"shard-(\d+)", re.ASCII)   # 6 digits grow to 7 past shard 999999


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


def gate_event(run: str, kind: GateEvent, stamp: str) -> str:
    """A pause or a resume; stamps sort chronologically."""
    return f"runs/{run}/gates/{kind}-{stamp}.json"


def bench_prefix(run: str, decider: str = "") -> str:
    """``bench --run``'s verdicts on the run, under what decides each (GPU model, TP, engine
    arguments: :class:`common.runs.bench_verdict.Decider`)."""
    return f"runs/{run}/bench/{decider}/" if decider else f"runs/{run}/bench/"


def bench_verdict(run: str, decider: str, stamp: str) -> str:
    """One bench's table and winner per concurrency; put-once, the newest write decides."""
    return f"runs/{run}/bench/{decider}/verdict-{stamp}.json"


def report_png(run: str, stamp: str) -> str:
    """A report's plots; one per ``report`` call, never overwritten."""
    return f"runs/{run}/reports/report-{stamp}.png"


def evals_prefix(run: str) -> str:
    """``eval-drafter --dataset``'s stored tables (:mod:`common.runs.evals`)."""
    return f"runs/{run}/evals/"


def eval_record(run: str, stamp: str) -> str:
    """One ``eval-drafter --dataset`` invocation's per-set table; put-once, never replaced."""
    return f"runs/{run}/evals/eval-{stamp}.json"


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


def failed_shard(run: str, shard: int, stamp: str, stage: str = Stage.GENERATE) -> str:
    """A parked shard's reason; one object per parking so history is never overwritten."""
    where = "" if stage == Stage.GENERATE else f"{stage}/"
    return f"runs/{run}/failed/{where}{shard_name(shard)}/{stamp}.json"


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


def access_probe(area: str) -> str:
    """A worker's start-up write probe in its stage's area (``generated``, ``hidden``,
    ``drafter``): written once per storage root, refused where the key may not write there."""
    return f"runs/{ACCESS_PROBE_RUN}/{area}/_PROBE"


def doctor_probe(area: str, token: str) -> str:
    """``doctor``'s read-after-write probe in an area (``token``: 32 hex digits, unique)."""
    return f"runs/{ACCESS_PROBE_RUN}/{area}/doctor-{token}"



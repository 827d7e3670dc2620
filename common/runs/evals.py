"""``eval-drafter --dataset``'s table stored under the run, and read back by ``report`` and the
dashboard: one put-once record per invocation (``runs/<run>/evals/eval-<stamp>.json``).

    key = write_eval(storage, run, result, drafter_step=400, drafter_dir=None)
    found = newest_eval(storage, run)      # {"record": {...}, "key": ..., "skipped": [...]}
    print(render_table(found["record"]))   # the same table eval-drafter prints

The train worker's key writes it (the command runs beside the target and the GPU); every other
key may only read it. A record that does not read, or does not hold the table's shape, is noted
(:func:`common.reads.note`) and passed over for the one before it, at most :data:`READ_AT_MOST`
of them: a reader never stops on one.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import time
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from common import keys
from common.errors import ForeignObject, NotFound
from common.reads import note, read_json
from common.runs.schemas import EVAL_RECORD
from common.storage import Storage

log = logging.getLogger(__name__)

READ_AT_MOST = 20   # newest records tried before a reader gives up (a flood stays bounded)

# Where a verify step starts in the generation (tokens generated before it), in tokens.
BUCKETS: tuple[tuple[str, int, float], ...] = (
    ("0-1k", 0, 1024), ("1k-4k", 1024, 4096), ("4k-16k", 4096, 16384),
    ("16k+", 16384, float("inf")))

DEFINITION = {
    "tau": "ours: accepted drafts + 1 per verify step, averaged over a prompt's steps, then "
           "over prompts (the prefill's token not counted)",
    "tau_pooled": "ours pooled: every verify step of every prompt weighted alike (sum of "
                  "accepted drafts + 1 over all steps / all verify steps)",
    "spec_accept_length": "SGLang's meta_info.spec_accept_length: completion tokens / "
                          "spec_verify_ct per request (includes the prefill's token), mean "
                          "over requests",
    "by_position": "tau of the verify steps whose first token falls in that range of the "
                   "generation (tokens 0-1024, 1024-4096, 4096-16384, 16384+); null: no step",
    "lossless": "prompts checked against plain greedy decoding, and the ones that differ",
    "tokens_per_s": "output tokens / wall seconds of the set at that concurrency (engine)",
    "speedup": "tokens_per_s over the baseline server's at the same concurrency (engine)",
    "concurrency": "per concurrency level: tokens_per_s, baseline_tokens_per_s, speedup, "
                   "spec_accept_length; the entry's own tokens_per_s and speedup are the "
                   "lowest level's",
}


def new_stamp() -> str:
    """UTC time to the microsecond and a random tag: sorts by time, never taken twice."""
    now = time.time()
    return (time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}-"
            + secrets.token_hex(3))


def eval_record(run: str, stamp: str, result: Mapping[str, Any], step: int | None,
                drafter_dir: str | None) -> dict[str, Any]:
    """The stored record of one ``--dataset`` result: the drafter (checkpoint step or the
    directory's name), engine, thinking, sets, and every field ``--json`` prints."""
    datasets = dict(result["datasets"])
    return {**{k: v for k, v in result.items() if k != "drafter"},
            "run": run, "stamp": stamp,
            "drafter": {"step": step if drafter_dir is None else None,
                        "name": PurePath(drafter_dir).name if drafter_dir else None},
            "sets": list(datasets), "datasets": datasets}


def write_eval(storage: Storage, run: str, result: Mapping[str, Any], step: int | None,
               drafter_dir: str | None) -> str:
    """Store ``result`` under the run (put-once); its key. StorageRefused where the key may
    not write there (any key but the train worker's)."""
    import orjson

    while True:
        stamp = new_stamp()
        record = eval_record(run, stamp, result, step, drafter_dir)
        EVAL_RECORD.validate_python(record)   # what readers will check, checked at the source
        key = keys.eval_record(run, stamp)
        if storage.put_once(key, orjson.dumps(record, option=orjson.OPT_INDENT_2)):
            log.info("run %s: eval stored at %s", run, key)
            return key


def newest_eval(storage: Storage, run: str) -> dict[str, Any] | None:
    """The record storage wrote last (ties by key) that reads as a table, with the keys of
    newer ones passed over (noted: foreign); None when the run has none that reads."""
    # The newest few kept as the listing streams by (S3 pages it): memory holds READ_AT_MOST
    # entries however many records the run has, never the whole listing.
    listed = heapq.nlargest(READ_AT_MOST, (
        (o.modified, o.key) for o in storage.list_objects(keys.evals_prefix(run))
        if (k := keys.parse(o.key)) is not None and k.kind is keys.KeyKind.EVAL))
    skipped: list[dict[str, str]] = []
    for _, key in listed:
        try:
            record = read_json(storage, key, EVAL_RECORD)
            prove_eval(key, run, record)
        except ForeignObject as exc:
            note(exc)
            skipped.append({"key": key, "why": exc.why[:300]})
            continue
        except NotFound:
            continue
        return {"key": key, "record": record, "skipped": skipped}
    return {"key": None, "record": None, "skipped": skipped} if skipped else None


def prove_eval(key: str, run: str, record: Mapping[str, Any]) -> None:
    """ForeignObject unless the schema-valid ``record`` is what :func:`write_eval` writes at
    ``key``: its run and stamp are the key's, every name prints on one line (a report line
    is never forged), and its figures are measures (no negative rate, level 0, or more
    mismatches than prompts checked): a reader never draws one."""
    why = _unproven(key, run, record)
    if why:
        raise ForeignObject(key, why[:300])


def _unproven(key: str, run: str, record: Mapping[str, Any]) -> str | None:
    if record["run"] != run:
        return f"a record of run {record['run']!r}"
    if keys.eval_record(run, record["stamp"]) != key:
        return f"its stamp {record['stamp']!r} is not its key's"
    drafter = record["drafter"]
    names = [*record["sets"], record["thinking"], drafter["name"] or "",
             *(record.get(k) or "" for k in ("url", "baseline_url", "device"))]
    for name, row in record["datasets"].items():
        names += [name, *row["by_position"]]
        figures = [row[k] for k in MEASURES] + [
            level[k] for level in (row["concurrency"] or {}).values() for k in LEVEL_MEASURES]
        if any(value is not None and value < 0 for value in figures):
            return f"set {name!r}: a negative figure"
        if any(int(level) < 1 for level in row["concurrency"] or {}):
            return f"set {name!r}: a concurrency level below 1"
        lossless = row["lossless"]
        if lossless and len(lossless["mismatches"]) > lossless["checked"]:
            return f"set {name!r}: more mismatches than prompts checked"
    bad = next((n for n in names if not n.isprintable()), None)
    return None if bad is None else f"a name that does not print on one line: {bad[:40]!r}"


MEASURES = ("tokens", "tau", "tau_pooled", "spec_accept_length", "tokens_per_s", "speedup")
LEVEL_MEASURES = ("tokens", "tokens_per_s", "spec_accept_length", "baseline_tokens_per_s",
                  "speedup")


def _cell(value: Any, width: int = 7) -> str:
    text = "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
    return text.rjust(width)


def render_table(result: Mapping[str, Any]) -> str:
    """The per-set table and, under it, each column's definition."""
    head = (f"{'set':<12}{'prompts':>8}{'tokens':>8}{'tau':>7}{'pooled':>7}{'sglang':>7}"
            + "".join(f"{name:>8}" for name, _, _ in BUCKETS) + f"{'lossless':>10}")
    lines = [head]
    levels: list[str] = []
    for name, row in result["datasets"].items():
        lossless = row["lossless"]
        same = (f"{lossless['checked'] - len(lossless['mismatches'])}/{lossless['checked']}"
                if lossless else "-")
        lines.append(f"{name:<12}{row['prompts']:>8}{_cell(row['tokens'], 8)}{_cell(row['tau'])}"
                     f"{_cell(row['tau_pooled'])}{_cell(row['spec_accept_length'])}"
                     + "".join(_cell(row["by_position"].get(b), 8) for b, _, _ in BUCKETS)
                     + same.rjust(10))
        for level, figures in (row["concurrency"] or {}).items():
            levels.append(f"{name:<12}{level:>6}{_cell(figures['tokens_per_s'], 10)}"
                          f"{_cell(figures['baseline_tokens_per_s'], 10)}"
                          f"{_cell(figures['speedup'], 9)}"
                          f"{_cell(figures['spec_accept_length'], 8)}")
    if levels:
        lines += ["", f"{'set':<12}{'conc':>6}{'tok/s':>10}{'base':>10}{'speedup':>9}"
                      f"{'sglang':>8}", *levels]
    lines += ["", "tau: " + DEFINITION["tau"], "pooled: " + DEFINITION["tau_pooled"],
              "sglang: " + DEFINITION["spec_accept_length"],
              "by position: " + DEFINITION["by_position"]]
    if levels:
        lines += ["tok/s: " + DEFINITION["tokens_per_s"], "speedup: " + DEFINITION["speedup"]]
    return "\n".join(lines)

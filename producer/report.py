"""``dflash-pipeline report --run RUN [--json] [--png PATH] [--no-png]``: sample quality of a run.

Reads storage only (no Redis): run.json, the inputs manifest, the pause records under ``gates/``
and every generated and gate-rejected part, streamed one part at a time and deduplicated by
sample id (first part in key order wins, generated before rejected). The PNG (token histograms,
rejection reasons) goes to ``runs/<run>/reports/`` and, with ``--png PATH``, to a local file;
a key that may only read (a dashboard's, a colleague's) gets the text and, where the storage
refuses the figure, one line saying so (exit 0): ``--png PATH`` is then its only copy.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

from common import keys
from common.choices import Role
from common.cli import options_for
from common.config import Settings
from common.errors import ConfigError, StorageRefused
from common.gates.partstats import turn_counts
from common.monitor.run_monitor import pause_from_storage
from common.queue.redis_values import field_key, number_of
from common.reads import part_getter, rows_or_none
from common.runs.commit_cache import fetch
from common.runs.schemas import SAMPLE
from common.runs.store import RunStore
from common.storage import Storage, open_storage
from producer.report_evals import eval_lines, eval_section
from producer.report_figure import bin_of, render_png

log = logging.getLogger(__name__)

MAX_EXAMPLES, MAX_DUP_IDS, MAX_DUP_GROUPS, ANSWER_CHARS, BAR_WIDTH = 3, 5, 20, 200, 40

def token_stats(values: Counter[int]) -> dict[str, Any]:
    """Histogram (non-empty bins only), exact mode, mean, nearest-rank median, min and max."""
    n = sum(values.values())
    if not n:
        return {"histogram": [], "mode": None, "mode_count": 0, "mean": None, "p50": None,
                "min": None, "max": None}
    bins: Counter[tuple[int, int]] = Counter()
    for value, count in values.items():
        bins[bin_of(value)] += count
    mode, mode_count = min(values.items(), key=lambda item: (-item[1], item[0]))
    cumulative = 0
    for p50 in sorted(values):  # nearest-rank median
        cumulative += values[p50]
        if 2 * cumulative >= n:
            break
    return {
        "histogram": [{"lo": lo, "hi": hi, "count": c} for (lo, hi), c in sorted(bins.items())],
        "mode": mode, "mode_count": mode_count,
        "mean": round(sum(v * c for v, c in values.items()) / n, 2), "p50": p50,
        "min": min(values), "max": max(values),
    }


def last_answer(record: Mapping[str, Any]) -> str:
    """The first 200 characters of the sample's last assistant content."""
    for message in reversed(record.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == Role.ASSISTANT:
            return str(message.get("content") or "")[:ANSWER_CHARS]
    return ""


def _detail(quality: dict[str, Any], code: str) -> str:
    """The human detail of one reason code (details run parallel to reasons when one each)."""
    reasons, details = quality.get("reasons") or [], [str(d) for d in quality.get("details") or []]
    if len(reasons) == len(details) and code in reasons:
        return details[reasons.index(code)]
    return "; ".join(details)


class _Tally:
    """Counters over a stream of samples; keeps ids (for dedup) and a few examples only."""

    def __init__(self) -> None:
        self.accepted = self.rejected = 0
        self.turns = self.turns_rejected = self.stopped = 0
        self.modes: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.finish: Counter[str] = Counter()
        self.supervised: Counter[int] = Counter()
        self.thinking: Counter[int] = Counter()
        self.seen: set[str] = set()
        self.first_of_hash: dict[str, str] = {}
        self.dups: dict[str, list[Any]] = {}  # answer_hash -> [count, ids]
        self.examples: dict[str, list[dict[str, str]]] = {}

    def add(self, record: Mapping[str, Any], rejected: bool) -> None:
        sample_id = str(record.get("id", ""))
        if sample_id:
            if sample_id in self.seen:
                return
            self.seen.add(sample_id)
        quality = record.get("quality") or {}
        turns: list[Mapping[str, Any]] = [t for t in record.get("turns") or []
                                          if isinstance(t, dict)]
        self.rejected += rejected
        self.accepted += not rejected
        if "passed" in quality:
            judged, failed = turn_counts(quality)
            self.turns, self.turns_rejected = self.turns + judged, self.turns_rejected + failed
        self.stopped += bool(quality.get("stopped")) and not rejected
        thinking = record.get("thinking")
        self.modes["unknown" if thinking is None else "on" if thinking else "off"] += 1
        for turn in turns or [record]:
            self.finish[str(turn.get("finish_reason") or "unknown")] += 1
        self.supervised.update(int(v) for v in quality["supervised_tokens"])
        self.thinking.update(int(v) for v in quality.get("thinking_tokens") or [])
        digest = str(quality.get("answer_hash") or "")
        first = self.first_of_hash.setdefault(digest, sample_id) if digest else sample_id
        if first != sample_id:
            group = self.dups.setdefault(digest, [1, [first]])
            group[0] += 1
            if len(group[1]) < MAX_DUP_IDS:
                group[1].append(sample_id)
        stopped = quality.get("stopped") if not rejected else None
        if stopped:   # kept up to a rejected later turn: counted under that turn's reasons
            quality = {"reasons": stopped.get("reasons"), "details": stopped.get("details")}
        if rejected or stopped:
            for code in quality.get("reasons") or ["unknown"]:
                self.reasons[code] += 1
                shown = self.examples.setdefault(code, [])
                if len(shown) < MAX_EXAMPLES:
                    shown.append({"id": sample_id, "detail": _detail(quality, code),
                                  "answer": last_answer(record)})


def build_report(storage: Storage, run: str) -> dict[str, Any]:
    """The report of a run, streaming its parts (bounded and typed: a foreign one is noted and
    left out); raises RunNotFound for an unknown run."""
    store = RunStore(storage, run)
    config = store.config_or_none()
    if config is None:
        raise store.missing()
    found = store.manifest()
    manifest = found.to_json() if found is not None else {}
    tally, parts = _Tally(), 0
    rejected_area = keys.rejected_prefix(run)
    names = [key for prefix in (keys.generated_prefix(run), rejected_area)
             for key in storage.list(prefix)  # key order; skips commits, rejected input rows
             if keys.part_number(key) is not None and keys.shard_of(key) is not None]
    for key, data in fetch(storage, names, get=part_getter(storage)):  # read ahead, in order
        parts += 1
        for record in rows_or_none(storage, key, SAMPLE, data, store.sample_caps) or []:
            tally.add(record, key.startswith(rejected_area))
    log.debug("run %s: read %d parts, %d samples", run, parts, len(tally.seen))
    total = tally.accepted + tally.rejected
    dups = sorted(tally.dups.items(), key=lambda item: (-item[1][0], item[0]))[:MAX_DUP_GROUPS]
    return {
        "run": run,
        "samples": {"total": total, "accepted": tally.accepted, "rejected": tally.rejected,
                    "input_rejected": int(manifest.get("rejected") or 0)},
        "rejection_rate": round(tally.rejected / total, 4) if total else 0.0,
        # Turns: a conversation stops at its first rejected turn; ``stopped`` conversations
        # kept the turns before it (accepted), their rejected turn counted under its reasons.
        "turns": {"judged": tally.turns, "rejected": tally.turns_rejected,
                  "stopped_conversations": tally.stopped},
        "thinking": dict(tally.modes),
        "reasons": dict(tally.reasons.most_common()),
        "finish_reasons": dict(tally.finish.most_common()),
        "supervised_tokens": token_stats(tally.supervised),
        "thinking_tokens": token_stats(tally.thinking),
        "duplicates": [{"answer_hash": h, "count": c, "ids": ids} for h, (c, ids) in dups],
        "examples": tally.examples,
        "gates": config.to_json().get("gates") or None,
        "paused": pause_from_storage(storage, run),
        "drafter": drafter_history(storage, run),
        "eval": eval_section(storage, run),   # the newest stored eval-drafter --dataset table
        "png": None,
        "png_not_stored": None,   # why the storage refused the figure (a read-only key)
    }


def drafter_history(storage: Storage, run: str) -> list[dict[str, Any]]:
    """Per checkpoint: step, loss, measured tau and the training estimate (online runs)."""
    from common.runs.checkpoints import metrics_history

    def number(m: dict[str, Any], name: str) -> float | None:
        """A metric the trainer recorded; one that is no finite number is noted, and absent."""
        return number_of(field_key(keys.drafter_prefix(run), f"metrics.{name}"), m.get(name))

    return [{"step": m["step"], "loss": number(m, "loss"), "tau": number(m, "tau"),
             "tau_step": number(m, "tau_step"), "estimate": number(m, "acceptance_length")}
            for m in metrics_history(storage, run)]


def _histogram_lines(title: str, stats: dict[str, Any]) -> list[str]:
    if not stats["histogram"]:
        return [f"{title}: no samples yet"]
    lines = [f"{title}: mode {stats['mode']} ({stats['mode_count']} turns), mean "
             f"{stats['mean']}, p50 {stats['p50']}, min {stats['min']}, max {stats['max']}"]
    top = max(b["count"] for b in stats["histogram"])
    for b in stats["histogram"]:
        label = f"[{b['lo']}, {b['hi']})".rjust(14)
        bar = "█" * max(1, round(BAR_WIDTH * b["count"] / top))
        line = f"  {label} {b['count']:>7} {bar}"
        if b["lo"] <= stats["mode"] < b["hi"]:
            line = click.style(f"{line}  <- mode {stats['mode']}", fg="yellow", bold=True)
        lines.append(line)
    return lines


def render_text(report: dict[str, Any]) -> str:
    """The terminal report: counts, reasons, finish reasons, histograms, examples, pause state."""
    s, total = report["samples"], report["samples"]["total"]
    lines = [f"run {report['run']}: {total} samples, {s['accepted']} accepted, {s['rejected']} "
             f"rejected by the gates ({report['rejection_rate']:.1%}); {s['input_rejected']} "
             "input rows rejected at enqueue"]
    turns, modes = report["turns"], report["thinking"]
    lines.append(f"turns: {turns['judged']} judged, {turns['rejected']} rejected; "
                 f"{turns['stopped_conversations']} conversations kept up to a rejected turn; "
                 "thinking " + ", ".join(f"{k} {v}" for k, v in sorted(modes.items())))
    pause = report["paused"]
    lines.append(click.style(f"PAUSED: {pause.get('reason', '?')} (checked {pause.get('checked')}"
                             f", rejected {pause.get('rejected')})", fg="red", bold=True)
                 if pause else "not paused")
    if report["gates"]:
        lines.append("gates: " + ", ".join(f"{k}={v}" for k, v in report["gates"].items()))
    lines.append("rejection reasons:" if report["reasons"] else "rejection reasons: none")
    lines += [f"  {code:<20} {n:>7} {n / total:6.1%}" for code, n in report["reasons"].items()]
    lines.append("finish reasons (per turn): " + (", ".join(
        f"{k} {v}" for k, v in report["finish_reasons"].items()) or "none"))
    lines += _histogram_lines("supervised tokens per turn", report["supervised_tokens"])
    lines += _histogram_lines("thinking tokens per turn", report["thinking_tokens"])
    for group in report["duplicates"]:
        lines.append(f"duplicate answer {group['answer_hash']} x{group['count']}: "
                     + ", ".join(group["ids"]))
    for code, shown in report["examples"].items():
        lines.append(f"examples of {code}:")
        for ex in shown:
            answer = " ".join(ex["answer"].split())[:100]
            lines.append(f"  {ex['id']}: {ex['detail']}\n      answer: {answer!r}")
    measured = [d for d in report.get("drafter") or [] if d["tau"] is not None]
    if measured:
        lines.append("drafter acceptance length (speculative decoding of held-out prompts):")
        lines += [f"  step {d['step']:>7}: tau {d['tau']:.3f}, training estimate "
                  f"{d['estimate'] if d['estimate'] is not None else '?'}, loss {d['loss']}"
                  for d in measured[-10:]]
    lines += eval_lines(report.get("eval"))
    if pause and pause.get("examples"):
        lines.append("behind the pause: " + ", ".join(
            f"{ex.get('id')} ({', '.join(ex.get('reasons') or [])})" for ex in pause["examples"]))
    return "\n".join(lines)


def save_png(storage: Storage, run: str, data: bytes) -> str:
    """Write the PNG once under ``runs/<run>/reports/``; returns its full location."""
    while True:
        stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
        key = keys.report_png(run, stamp)
        if storage.put_once(key, data):
            return f"{storage.root.rstrip('/')}/{key}"


def store_png(storage: Storage, run: str, data: bytes) -> tuple[str | None, str | None]:
    """``(where the figure went, None)``, or ``(None, why)`` when the storage refuses the write
    (a read-only key: readers get one; the report itself needs none)."""
    try:
        return save_png(storage, run, data), None
    except StorageRefused as exc:
        log.debug("run %s: report figure not stored: %s", run, exc)
        return None, str(exc).split(": ", 1)[-1]   # the service's code and message


def report_command(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]
                   ) -> click.Command:
    """The ``report`` command, wrapped in the CLI's shared --storage/--broker-url options."""

    @click.command()
    @options_for("report")
    @common_options
    def report(settings: Settings, run: str, as_json: bool, png_path: Path | None,
               no_png: bool) -> None:
        """Sample counts, gate rejections, token histograms and pause state of a run."""
        if png_path is not None and no_png:
            raise click.UsageError("--png and --no-png contradict each other")
        if not keys.valid_run_id(run):
            raise ConfigError(f"invalid run id {run!r}")
        storage = open_storage(settings.broker.storage, settings.read)
        result = build_report(storage, run)
        if not no_png:
            data = render_png(result)
            if png_path is not None:
                png_path.parent.mkdir(parents=True, exist_ok=True)
                png_path.write_bytes(data)
            result["png"], result["png_not_stored"] = store_png(storage, run, data)
        if as_json:
            click.echo(json.dumps(result, sort_keys=True))
            return
        click.echo(render_text(result))
        if result["png"]:
            click.echo(f"PNG: {result['png']}" + (f" (and {png_path})" if png_path else ""))
        elif result.get("png_not_stored"):
            click.echo(f"PNG not stored in the run's storage ({result['png_not_stored']}): "
                       + (f"written to {png_path} only" if png_path else
                          "pass --png FILE to write it to a local file"))

    return report

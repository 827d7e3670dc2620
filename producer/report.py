"""``dflash-pipeline report --run RUN [--json] [--png PATH] [--no-png]``: sample quality of a run.

Reads storage only (no Redis): run.json, the inputs manifest, the pause records under ``gates/``
and every generated and gate-rejected part, streamed one part at a time and deduplicated by
sample id (first part in key order wins, generated before rejected). The PNG (token histograms,
rejection reasons) goes to ``runs/<run>/reports/`` and, with ``--png PATH``, to a local file.
"""

from __future__ import annotations

import io
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common import keys
from common.config import Settings
from common.errors import ConfigError, NotFound
from common.monitor import pause_from_storage
from common.records import decode_jsonl_zst
from common.storage import Storage, open_storage

log = logging.getLogger(__name__)

EXACT_BELOW = 16  # width-1 bins below this, power-of-two bins from here up
MAX_EXAMPLES, MAX_DUP_IDS, MAX_DUP_GROUPS, ANSWER_CHARS, BAR_WIDTH = 3, 5, 20, 200, 40


def bin_of(value: int) -> tuple[int, int]:
    """The histogram bin [lo, hi) of a token count: exact below 16, then powers of two."""
    value = max(int(value), 0)
    if value < EXACT_BELOW:
        return value, value + 1
    lo = 1 << (value.bit_length() - 1)
    return lo, 2 * lo


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


def last_answer(record: dict[str, Any]) -> str:
    """The first 200 characters of the sample's last assistant content."""
    for message in reversed(record.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "assistant":
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
        self.reasons: Counter[str] = Counter()
        self.finish: Counter[str] = Counter()
        self.supervised: Counter[int] = Counter()
        self.thinking: Counter[int] = Counter()
        self.seen: set[str] = set()
        self.first_of_hash: dict[str, str] = {}
        self.dups: dict[str, list[Any]] = {}  # answer_hash -> [count, ids]
        self.examples: dict[str, list[dict[str, str]]] = {}

    def add(self, record: dict[str, Any], rejected: bool) -> None:
        sample_id = str(record.get("id", ""))
        if sample_id:
            if sample_id in self.seen:
                return
            self.seen.add(sample_id)
        quality = record.get("quality") or {}
        turns = [t for t in record.get("turns") or [] if isinstance(t, dict)]
        self.rejected += rejected
        self.accepted += not rejected
        for turn in turns or [record]:
            self.finish[str(turn.get("finish_reason") or "unknown")] += 1
        supervised = quality.get("supervised_tokens")
        if supervised is None:  # samples written before the gates: count the output ids
            supervised = [len(t.get("output_ids") or []) or t.get("completion_tokens", 0)
                          for t in turns]
        self.supervised.update(int(v) for v in supervised)
        self.thinking.update(int(v) for v in quality.get("thinking_tokens") or [])
        digest = str(quality.get("answer_hash") or "")
        first = self.first_of_hash.setdefault(digest, sample_id) if digest else sample_id
        if first != sample_id:
            group = self.dups.setdefault(digest, [1, [first]])
            group[0] += 1
            if len(group[1]) < MAX_DUP_IDS:
                group[1].append(sample_id)
        if rejected:
            for code in quality.get("reasons") or ["unknown"]:
                self.reasons[code] += 1
                shown = self.examples.setdefault(code, [])
                if len(shown) < MAX_EXAMPLES:
                    shown.append({"id": sample_id, "detail": _detail(quality, code),
                                  "answer": last_answer(record)})


def _read_json(storage: Storage, key: str) -> Any:
    """A JSON object from storage, or None when it is absent or unreadable."""
    try:
        return json.loads(storage.get(key))
    except NotFound:
        return None
    except ValueError as exc:
        log.warning("ignoring unreadable %s: %s", key, exc)
        return None


def build_report(storage: Storage, run: str) -> dict[str, Any]:
    """The report of a run, streaming its parts; raises NotFound for an unknown run."""
    config = _read_json(storage, keys.run_config(run))
    if not isinstance(config, dict):
        raise NotFound(f"run {run!r} not found in {storage.root} (no {keys.run_config(run)})")
    manifest = _read_json(storage, keys.inputs_manifest(run))
    manifest = manifest if isinstance(manifest, dict) else {}
    tally, parts = _Tally(), 0
    for rejected in (False, True):
        prefix = (keys.rejected_prefix if rejected else keys.generated_prefix)(run)
        for key in storage.list(prefix):  # key order; skips commits and rejected input rows
            if keys.part_number(key) is None or keys.shard_of(key) is None:
                continue
            parts += 1
            for record in decode_jsonl_zst(storage.get(key)):
                tally.add(record, rejected)
    log.debug("run %s: read %d parts, %d samples", run, parts, len(tally.seen))
    total = tally.accepted + tally.rejected
    dups = sorted(tally.dups.items(), key=lambda item: (-item[1][0], item[0]))[:MAX_DUP_GROUPS]
    return {
        "run": run,
        "samples": {"total": total, "accepted": tally.accepted, "rejected": tally.rejected,
                    "input_rejected": int(manifest.get("rejected") or 0)},
        "rejection_rate": round(tally.rejected / total, 4) if total else 0.0,
        "reasons": dict(tally.reasons.most_common()),
        "finish_reasons": dict(tally.finish.most_common()),
        "supervised_tokens": token_stats(tally.supervised),
        "thinking_tokens": token_stats(tally.thinking),
        "duplicates": [{"answer_hash": h, "count": c, "ids": ids} for h, (c, ids) in dups],
        "examples": tally.examples,
        "gates": config.get("gates") or None,
        "paused": pause_from_storage(storage, run),
        "png": None,
    }


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
    if pause and pause.get("examples"):
        lines.append("behind the pause: " + ", ".join(
            f"{ex.get('id')} ({', '.join(ex.get('reasons') or [])})" for ex in pause["examples"]))
    return "\n".join(lines)


def _plot_histogram(ax: Any, stats: dict[str, Any], title: str, floor: int | None) -> None:
    ax.set_title(title)
    ax.set_xscale("symlog", linthresh=1, linscale=0.4, base=2)
    ax.set_xlabel("tokens per turn (exact bins below 16, then powers of two)")
    ax.set_ylabel("turns")
    if not stats["histogram"]:
        ax.text(0.5, 0.5, "no samples yet", ha="center", va="center", transform=ax.transAxes)
        return
    for b in stats["histogram"]:
        below = floor is not None and b["hi"] <= floor
        ax.bar(b["lo"], b["count"], width=b["hi"] - b["lo"], align="edge",
               color="tab:red" if below else "tab:blue", edgecolor="white")
    top = max(b["count"] for b in stats["histogram"])
    mode_bin = bin_of(stats["mode"])
    ax.annotate(f"mode {stats['mode']} ({stats['mode_count']} turns)",
                xy=((mode_bin[0] + mode_bin[1]) / 2, stats["mode_count"]),
                xytext=(-4, 12), textcoords="offset points", ha="left", fontweight="bold",
                arrowprops={"arrowstyle": "->"})
    ax.set_ylim(0, top * 1.2)
    if floor is not None:
        ax.axvline(floor, color="black", linestyle="--", label=f"min_supervised_tokens = {floor}")
        ax.legend(loc="upper right")
    ticks = [0] + [1 << i for i in range(0, max(int(stats["max"]), 1).bit_length() + 1)]
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=8)


def render_png(report: dict[str, Any]) -> bytes:
    """The report figure as PNG bytes (matplotlib's Agg canvas, imported only here)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplot_mosaic([["supervised", "supervised"], ["thinking", "reasons"]])
    s, gates, pause = report["samples"], report["gates"] or {}, report["paused"]
    fig.suptitle(f"run {report['run']}: {s['total']} samples, {s['accepted']} accepted, "
                 f"{s['rejected']} rejected ({report['rejection_rate']:.1%})"
                 + (f"; PAUSED: {pause.get('reason', '?')}" if pause else ""),
                 color="tab:red" if pause else "black", fontsize=11)
    floor = gates.get("min_supervised_tokens")
    _plot_histogram(axes["supervised"], report["supervised_tokens"],
                    "supervised tokens per turn"
                    + (" (red: below min_supervised_tokens)" if floor is not None else ""), floor)
    _plot_histogram(axes["thinking"], report["thinking_tokens"], "thinking tokens per turn", None)
    ax = axes["reasons"]
    ax.set_title("gate rejections by reason")
    reasons = report["reasons"]
    if reasons:
        codes = list(reasons)[::-1]
        bars = ax.barh(codes, [reasons[c] for c in codes], color="tab:orange")
        ax.bar_label(bars, padding=3)
        ax.set_xlabel("rejected samples")
    else:
        ax.text(0.5, 0.5, "no gate rejections", ha="center", va="center", transform=ax.transAxes)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def save_png(storage: Storage, run: str, data: bytes) -> str:
    """Write the PNG once under ``runs/<run>/reports/``; returns its full location."""
    while True:
        stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
        key = keys.report_png(run, stamp)
        if storage.put_once(key, data):
            return f"{storage.root.rstrip('/')}/{key}"


def report_command(common_options: Callable[[Callable[..., Any]], Callable[..., Any]]
                   ) -> click.Command:
    """The ``report`` command, wrapped in the CLI's shared --storage/--broker-url options."""

    @click.command()
    @click.option("--run", required=True, envvar="DFLASH_RUN", help="Run id to report on.")
    @click.option("--json", "as_json", is_flag=True, envvar="DFLASH_REPORT_JSON",
                  help="Print the report as one JSON object.")
    @click.option("--png", "png_path", type=click.Path(dir_okay=False, path_type=Path),
                  default=None, envvar="DFLASH_REPORT_PNG",
                  help="Also write the PNG figure to this local file.")
    @click.option("--no-png", is_flag=True, envvar="DFLASH_REPORT_NO_PNG",
                  help="Do not render or store the PNG figure.")
    @common_options
    def report(settings: Settings, run: str, as_json: bool, png_path: Path | None,
               no_png: bool) -> None:
        """Sample counts, gate rejections, token histograms and pause state of a run."""
        if png_path is not None and no_png:
            raise click.UsageError("--png and --no-png contradict each other")
        if not keys.valid_run_id(run):
            raise ConfigError(f"invalid run id {run!r}")
        storage = open_storage(settings.storage)
        result = build_report(storage, run)
        if not no_png:
            data = render_png(result)
            result["png"] = save_png(storage, run, data)
            if png_path is not None:
                png_path.parent.mkdir(parents=True, exist_ok=True)
                png_path.write_bytes(data)
        if as_json:
            click.echo(json.dumps(result, sort_keys=True))
            return
        click.echo(render_text(result))
        if result["png"]:
            click.echo(f"PNG: {result['png']}" + (f" (and {png_path})" if png_path else ""))

    return report

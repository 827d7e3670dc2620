"""The newest stored ``eval-drafter --dataset`` table in ``report`` (text, ``--json``'s ``eval``,
a bar chart in the figure) and on the dashboard (``/api/runs/<run>/evals``).

    found = eval_section(storage, run)   # {"key", "record", "skipped"} or None
    lines = eval_lines(found)            # the table as eval-drafter printed it, and its source
    plot_eval(ax, found["record"])       # tau per set, speedup at each concurrency

A stored record that does not read as a table is noted and passed over
(:func:`common.runs.evals.newest_eval`); each one passed over is named in a line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.runs.evals import newest_eval, render_table
from common.storage import Storage


def eval_section(storage: Storage, run: str) -> dict[str, Any] | None:
    """``report --json``'s ``eval``: the newest readable record, its key and the records
    passed over; None when the run has no stored eval."""
    return newest_eval(storage, run)


def drafter_label(record: Mapping[str, Any]) -> str:
    """``drafter step 400`` or ``drafter DIRNAME`` (a directory measured with --drafter)."""
    drafter = record["drafter"]
    if drafter["name"]:
        return f"drafter {drafter['name']}"
    return f"drafter step {drafter['step']}" if drafter["step"] is not None else "drafter ?"


def eval_lines(found: Mapping[str, Any] | None) -> list[str]:
    """The text section: the record's source line and its table; skipped records named."""
    if not found:
        return []
    lines = [f"stored eval record {s['key']} skipped: {s['why']}" for s in found["skipped"]]
    record = found["record"]
    if record is None:
        return [*lines, "drafter eval: no stored record reads"]
    where = f" at {record['url']}" if record.get("url") else ""
    lines.append(f"drafter eval {record['stamp']} ({drafter_label(record)}, engine "
                 f"{record['engine']}{where}, thinking {record['thinking']}, up to "
                 f"{record['max_new_tokens']} new tokens; {found['key']}):")
    lines += ["  " + line if line else "" for line in render_table(record).splitlines()]
    return lines


def bars(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per set: the bar's height (tau, or SGLang's spec_accept_length where our tau is not
    measured), which it is, and the speedup at each concurrency measured."""
    out = []
    for name, row in record["datasets"].items():
        tau = row["tau"] if row["tau"] is not None else row["spec_accept_length"]
        speedups = {int(level): figures["speedup"]
                    for level, figures in (row["concurrency"] or {}).items()
                    if figures["speedup"] is not None}
        out.append({"set": name, "tau": tau,
                    "measure": "tau" if row["tau"] is not None else "spec_accept_length",
                    "speedup": speedups})
    return out


def plot_eval(ax: Any, record: Mapping[str, Any]) -> None:
    """Tau per set as bars; the speedup at each concurrency as points on a second axis."""
    shown = bars(record)
    names = [b["set"] for b in shown]
    heights = [b["tau"] or 0.0 for b in shown]
    ax.set_title(f"drafter eval {record['stamp']} ({drafter_label(record)}, "
                 f"{record['engine']}): acceptance length per set")
    drawn = ax.bar(names, heights, color="tab:green")
    ax.bar_label(drawn, labels=[f"{h:.2f}" if h else "-" for h in heights], padding=2)
    ax.set_ylabel("tau (sglang: spec_accept_length)")
    levels = sorted({level for b in shown for level in b["speedup"]})
    if levels:
        twin = ax.twinx()
        for level in levels:
            points = [(i, b["speedup"][level]) for i, b in enumerate(shown)
                      if level in b["speedup"]]
            twin.plot(*zip(*points, strict=True), marker="o", linestyle="none",
                      label=f"speedup at concurrency {level}")
        twin.axhline(1.0, color="grey", linewidth=0.8)
        twin.set_ylabel("speedup over the baseline server")
        twin.legend(loc="upper right")

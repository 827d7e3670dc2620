"""The ``report`` figure: token histograms, gate rejections and, for online runs, the drafter's
acceptance length over training steps; the newest stored eval's tau per set and speedups.
Matplotlib's Agg canvas, imported only when drawing.
"""

from __future__ import annotations

import io
from typing import Any

EXACT_BELOW = 16  # width-1 bins below this, power-of-two bins from here up


def bin_of(value: int) -> tuple[int, int]:
    """The histogram bin [lo, hi) of a token count: exact below 16, then powers of two."""
    value = max(int(value), 0)
    if value < EXACT_BELOW:
        return value, value + 1
    lo = 1 << (value.bit_length() - 1)
    return lo, 2 * lo


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

    drafter = [d for d in report.get("drafter") or [] if d["tau"] is not None]
    evaluated = (report.get("eval") or {}).get("record")
    rows = 2 + bool(drafter) + bool(evaluated)
    fig = Figure(figsize=(13, 3 * rows + 3), layout="constrained")
    FigureCanvasAgg(fig)
    mosaic: list[Any] = [["supervised", "supervised"], ["thinking", "reasons"]]
    axes = fig.subplot_mosaic(mosaic + ([["drafter", "drafter"]] if drafter else [])
                              + ([["eval", "eval"]] if evaluated else []))
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
    if drafter:
        _plot_drafter(axes["drafter"], drafter)
    if evaluated:
        from producer.report_evals import plot_eval

        plot_eval(axes["eval"], evaluated)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()




def _plot_drafter(ax: Any, history: list[dict[str, Any]]) -> None:
    steps = [d["step"] for d in history]
    ax.set_title("drafter acceptance length over training steps")
    ax.plot(steps, [d["tau"] for d in history], marker="o", label="tau (speculative decoding)")
    estimate = [(d["step"], d["estimate"]) for d in history if d["estimate"] is not None]
    if estimate:
        ax.plot(*zip(*estimate, strict=True), linestyle="--", label="training estimate")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens per verify step")
    ax.legend(loc="lower right")

"""``eval-drafter --dataset``'s per-set table: both acceptance definitions, by position, speed.

    entry = local_entry(decoded, report)             # the lossless loop's figures for one set
    entry = served_entry(levels)                     # the serving engine's, per concurrency
    result = {"datasets": {"gsm8k": entry}, "definition": DEFINITION}
    print(render_table(result))

Every entry has the same keys; what a mode cannot measure is null: the engine reports no
per-step yield (tau, tau_pooled, by_position, lossless), the lossless loop no serving speed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:     # torch only where a set is decoded
    from workers.train.drafter.specdec import Decoded

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

KEYS = ("prompts", "tokens", "tau", "tau_pooled", "spec_accept_length", "by_position",
        "lossless", "tokens_per_s", "speedup", "concurrency")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def by_position(results: Sequence[Decoded]) -> dict[str, float | None]:
    """Mean acceptance length of the verify steps starting in each bucket of the generation."""
    sums = {name: [0, 0] for name, _, _ in BUCKETS}
    for result in results:
        at = 1                                      # the prefill's token comes first
        for length in result.accepted:
            name = next(n for n, lo, hi in BUCKETS if lo <= at < hi)
            sums[name][0] += length
            sums[name][1] += 1
            at += length
    return {name: _round(total / steps) if steps else None
            for name, (total, steps) in sums.items()}


def sglang_accept_length(results: Sequence[Decoded]) -> float | None:
    """SGLang's figure from our loop: completion tokens / verify steps, mean over requests."""
    per = [len(r.tokens) / len(r.accepted) for r in results if r.accepted]
    return _round(sum(per) / len(per)) if per else None


def local_entry(results: Sequence[Decoded], report: Mapping[str, Any]) -> dict[str, Any]:
    """One set's row from the lossless loop (``report``: :meth:`EvalReport.to_json`)."""
    return {"prompts": report["prompts"], "tokens": report["tokens"], "tau": report["tau"],
            "tau_pooled": report["tau_pooled"],
            "spec_accept_length": sglang_accept_length(results),
            "by_position": by_position(results), "lossless": report["lossless"],
            "tokens_per_s": None, "speedup": None, "concurrency": None}


def served_entry(prompts: int, levels: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One set's row from the serving engine: ``levels`` maps concurrency to its figures."""
    first = levels[min(levels)]
    return {"prompts": prompts, "tokens": first["tokens"], "tau": None, "tau_pooled": None,
            "spec_accept_length": first["spec_accept_length"],
            "by_position": {name: None for name, _, _ in BUCKETS}, "lossless": None,
            "tokens_per_s": first["tokens_per_s"], "speedup": first["speedup"],
            "concurrency": {str(c): dict(levels[c]) for c in sorted(levels)}}


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
                     + "".join(_cell(row["by_position"][b], 8) for b, _, _ in BUCKETS)
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

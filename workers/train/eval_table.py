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

from common.runs.evals import BUCKETS, DEFINITION, render_table

__all__ = ["BUCKETS", "DEFINITION", "KEYS", "by_position", "local_entry", "render_table",
           "served_entry", "sglang_accept_length"]

if TYPE_CHECKING:     # torch only where a set is decoded
    from workers.train.drafter.specdec import Decoded

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

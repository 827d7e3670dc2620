"""What each generated part says about progress: who wrote it, when, in how long, how much.

A generate worker stamps every sample of a part with ``written`` (worker, write time, wall
seconds the part took); the shard's commit keeps one summary per part (``part_stats``), so
the dashboard's time series come from storage and survive a Redis or UI restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from common.choices import Role


@dataclass(frozen=True, slots=True)
class SampleStat:
    """What a commit (and the dashboard) needs of a sample, so parts are read once."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    reasons: tuple[str, ...]
    worker: str = ""
    at: float | None = None
    wall_s: float | None = None
    judgement: Judgement | None = None  # what the run monitor counts (None: never judged)
    # Each turn's training row: (tokens, generated tokens) (the training memory plan's lengths).
    rows: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, sample: Mapping[str, Any]) -> SampleStat:
        usage = sample.get("usage", {})
        quality = sample.get("quality", {})
        written = sample.get("written") or {}
        return cls(sample["id"], usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                   sample.get("finish_reason", "stop"), tuple(quality.get("reasons", ())),
                   str(written.get("worker", "")), written.get("at", quality.get("judged_at")),
                   written.get("wall_s"), Judgement.of(sample) if "quality" in sample else None,
                   row_lengths(sample))


def row_lengths(sample: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """``(tokens, generated tokens)`` of each turn's training row (``common.runs.trainrows``)."""
    turns = sample.get("turns") or ([sample] if "output_ids" in sample else [])
    return tuple((len(t.get("prompt_ids", ())) + len(t.get("output_ids", ())),
                  len(t.get("output_ids", ()))) for t in turns if isinstance(t, dict))


@dataclass(frozen=True, slots=True)
class Judgement:
    """A sample's gate verdict as the run monitor counts it; an example view if flagged."""

    passed: bool
    judged_at: float
    supervised_tokens: tuple[int, ...]
    answer_hash: str | None
    example: dict[str, Any] | None
    turns: tuple[int, int] = (0, 0)   # turns judged, turns rejected
    thinking_off: bool = False

    @property
    def flagged(self) -> bool:
        """A conversation with a rejected turn (the rolling window's 1)."""
        return self.example is not None

    @classmethod
    def of(cls, sample: Mapping[str, Any]) -> Judgement:
        quality = sample["quality"]
        return cls(bool(quality["passed"]), float(quality.get("judged_at") or 0.0),
                   tuple(int(t) for t in quality.get("supervised_tokens", ())),
                   quality.get("answer_hash"), example(sample) if flagged(quality) else None,
                   turn_counts(quality), quality.get("thinking") is False)


def flagged(quality: dict[str, Any]) -> bool:
    """Rejected, or kept only up to a rejected later turn: either way a turn failed a gate."""
    return not quality["passed"] or bool(quality.get("stopped"))


def flagged_reasons(quality: dict[str, Any]) -> list[str]:
    """The reasons a flagged sample is counted under (its rejected turn's, if it was kept)."""
    if not quality["passed"]:
        return list(quality["reasons"])
    return list((quality.get("stopped") or {}).get("reasons", ()))


def turn_counts(quality: dict[str, Any]) -> tuple[int, int]:
    """``(turns judged, turns rejected)`` of a sample; one without ``turns_passed`` (judged by
    :func:`common.gates.judge.judge` alone, not turn by turn) counts each of its turns judged
    whole."""
    kept = quality.get("turns_passed")
    if kept is None:
        judged = len(quality.get("supervised_tokens", ())) or 1
        return judged, 0 if quality["passed"] else judged
    failed = 1 if quality.get("stopped") or kept == 0 else 0
    return kept + failed, failed + (0 if quality["passed"] else kept)


EXAMPLE_FIELDS = ("id", "reasons", "details", "answer")  # the order the monitor stores them in


def example(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A short, readable view of a flagged sample for status and pause records."""
    quality = sample["quality"]
    stopped = quality.get("stopped") if quality["passed"] else None
    if stopped:
        answer = (stopped.get("answer") or {}).get("content") or ""
        return {"id": sample["id"], "reasons": list(stopped["reasons"]),
                "details": list(stopped.get("details", []))[:3], "answer": str(answer)[:200]}
    answers = [m for m in sample.get("messages", []) if m.get("role") == Role.ASSISTANT]
    last = (answers[-1].get("content") or "") if answers else ""
    return {"id": sample["id"], "reasons": list(quality["reasons"]),
            "details": list(quality.get("details", []))[:3], "answer": str(last)[:200]}


class WrittenStamp(TypedDict):
    """Who wrote a part and when (``at``: when its samples were judged; ``wall_s``: since the
    worker began the shard)."""

    worker: str
    at: float
    wall_s: float


def written_stamp(worker: str, at: float, wall_s: float) -> WrittenStamp:
    """The ``written`` field of every sample of a part."""
    return {"worker": worker, "at": at, "wall_s": round(wall_s, 3)}


def part_stats(known: Mapping[str, list[SampleStat]], generated_prefix: str,
               worker: str = "") -> dict[str, dict[str, Any]]:
    """One summary per part of a shard; ``samples``/``rejected`` count canonical copies only.

    The canonical copy of a sample is the commit's: generated parts before rejected ones,
    each area in key order, first part wins. ``tokens`` counts every generated token of the
    part (duplicates of a redelivery took engine time too).
    """
    seen: set[str] = set()
    out: dict[str, dict[str, Any]] = {}
    for key in sorted(known, key=lambda k: (not k.startswith(generated_prefix), k)):
        stats = known[key]
        new = [s for s in stats if s.id not in seen]
        seen.update(s.id for s in new)
        first = stats[0] if stats else None
        out[key] = {
            "worker": (first.worker if first and first.worker else worker),
            "at": first.at if first else None,
            "wall_s": first.wall_s if first else None,
            "samples": len(new),
            "rejected": 0 if key.startswith(generated_prefix) else len(new),
            "tokens": sum(s.completion_tokens for s in stats),
        }
    return out

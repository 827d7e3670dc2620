"""A shard's judgements in a few KB: what the run monitor counts, kept in its ``_COMMIT.json``.

The run monitor's state (counters, rolling window, supervised-token histogram, duplicate
answers, examples) is rebuilt from these: a commit carries its shard's share of that state
(``summary``), so a rebuild reads one object per committed shard; shards not committed yet are
summarised from their parts the same way. Samples are taken in the order the gates judged them,
as :func:`embedded.reference_monitor.judged_samples` does: judgement time, accepted before rejected,
then part key; the first judgement of a sample id wins (ids never repeat across shards).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.gates.partstats import Judgement, SampleStat

SUMMARY_VERSION = 1
EXAMPLES = 3
Judged = tuple[tuple[float, bool, int], str, Judgement]   # (order, sample id, verdict)


def shard_summary(known: Mapping[str, Sequence[SampleStat]]) -> dict[str, Any]:
    """The summary of one shard's parts (every part of the shard, canonical or not)."""
    judged: list[Judged] = []
    for key in sorted(known):
        for stat in known[key]:
            if stat.judgement is not None:
                order = (stat.judgement.judged_at, not stat.judgement.passed, len(judged))
                judged.append((order, stat.id, stat.judgement))
    judged.sort(key=lambda entry: entry[0])
    seen: set[str] = set()
    hist: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    groups: list[list[Any]] = []
    examples: dict[str, list[list[Any]]] = {}
    answers: dict[str, list[Any]] = {}
    rejected, turns, turns_rejected, thinking_off = 0, 0, 0, 0
    for index, (_, sample_id, verdict) in enumerate(_first(judged, seen)):
        hist.update(verdict.supervised_tokens)
        turns, turns_rejected = turns + verdict.turns[0], turns_rejected + verdict.turns[1]
        thinking_off += verdict.thinking_off
        if not groups or groups[-1][0] != verdict.judged_at:
            groups.append([verdict.judged_at, 0, 0])
        groups[-1][2 if verdict.flagged else 1] += 1
        if verdict.passed and verdict.answer_hash and verdict.answer_hash not in answers:
            answers[verdict.answer_hash] = [verdict.answer_hash, sample_id,
                                            verdict.judged_at, index]
        rejected += not verdict.passed
        if verdict.example is None:
            continue
        for reason in verdict.example["reasons"]:
            reasons[reason] += 1
            shown = examples.setdefault(reason, [])
            shown.append([verdict.judged_at, index, verdict.example])
            del shown[:-EXAMPLES]
    return {"v": SUMMARY_VERSION, "judged": len(seen), "rejected": rejected,
            "turns": [turns, turns_rejected], "thinking_off": thinking_off,
            "reasons": dict(reasons), "hist": {str(t): n for t, n in sorted(hist.items())},
            "groups": groups, "examples": examples, "answers": list(answers.values())}


def _first(judged: Iterable[Judged], seen: set[str]) -> Iterable[Judged]:
    """Each sample's first judgement, in order; ``seen`` collects the ids."""
    for entry in judged:
        if entry[1] not in seen:
            seen.add(entry[1])
            yield entry


def answer_order(shard: int, entry: Sequence[Any]) -> str:
    """A string that sorts answers run-wide in judgement order (earliest owns the answer)."""
    return f"{float(entry[2]):020.6f}{shard:09d}{int(entry[3]):06d}"


@dataclass
class RunSummary:
    """Shard summaries added up into the run monitor's state; memory grows with parts only."""

    judged: int = 0
    rejected: int = 0
    turns: int = 0
    turns_rejected: int = 0
    thinking_off: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    hist: Counter[int] = field(default_factory=Counter)
    groups: Counter[float] = field(default_factory=Counter)  # judged_at -> accepted
    rejected_at: Counter[float] = field(default_factory=Counter)  # judged_at -> rejected
    examples: dict[str, list[tuple[float, int, int, dict[str, Any]]]] = field(
        default_factory=dict)
    partial: dict[int, int] = field(default_factory=dict)

    def add(self, shard: int, summary: Mapping[str, Any], committed: bool) -> None:
        self.judged += summary["judged"]
        self.rejected += summary["rejected"]
        turns, turns_rejected = summary["turns"]
        self.turns, self.turns_rejected = self.turns + turns, self.turns_rejected + turns_rejected
        self.thinking_off += summary["thinking_off"]
        self.reasons.update(summary["reasons"])
        self.hist.update({int(t): n for t, n in summary["hist"].items()})
        for at, accepted, rejected in summary["groups"]:
            self.groups[at] += accepted
            self.rejected_at[at] += rejected
        for reason, shown in summary["examples"].items():
            newest = self.examples.setdefault(reason, [])
            for at, index, view in shown:
                heapq.heappush(newest, (at, shard, index, view))
                if len(newest) > EXAMPLES:
                    heapq.heappop(newest)
        if not committed and summary["judged"]:
            self.partial[shard] = summary["judged"]

    def window(self, size: int) -> list[int]:
        """The newest ``size`` outcomes (1 = rejected), newest first."""
        out: list[int] = []
        for at in sorted(self.groups.keys() | self.rejected_at.keys(), reverse=True):
            out += [1] * self.rejected_at[at] + [0] * self.groups[at]
            if len(out) >= size:
                break
        return out[:size]

    def newest_examples(self, reason: str) -> list[dict[str, Any]]:
        """The reason's latest examples, newest first (as the monitor's Redis list holds them)."""
        return [view for *_, view in sorted(self.examples.get(reason, []), reverse=True)]


"""A synthetic run the size of the seed, written through the project's own record writers.

Used by ``benchmarks/seed_scale.py``. Every object is what a real run leaves: run.json, input
shards and their manifest, generated and rejected parts (``ShardParts.write``, four flushes of
64 per shard as a worker writes them, stamped as ``PartBuffer`` stamps them), commits
(``ShardParts.commit``: part_stats and the monitor summary), a pause and two resumes under
``gates/``, a degenerate stretch, redelivered shards with duplicate copies, shards part-way and
parked, and hidden-state commits for the first part of the run. Bodies are short (a few token
ids, one-line answers) so that 902,087 samples fit this disk; token counts are realistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common import keys
from common.gates.judge import GateConfig, answer_hash
from common.runs.records import InputManifest, RunConfig, ShardTask, dumps, encode_jsonl_zst
from common.storage import Storage
from workers.generate.parts import ShardParts

RUN = "seed"
PART = 64
T0 = 1_764_000_000.0
SHARD_S = 40.0  # each shard's flushes are spread over this many seconds of synthetic time
GATES = GateConfig(pause_after=200, max_reject_rate=0.2)


@dataclass(frozen=True)
class Layout:
    """Which shards are in which state (the rest are committed)."""

    shards: int
    degenerate: range  # shards rejected at 60%: the run pauses after them
    part_way: frozenset[int]  # parts written, no commit
    parked: frozenset[int]  # a few parts, then parked (Redis says why)
    untouched: frozenset[int]  # never started
    redelivered: frozenset[int]  # a second attempt wrote one flush again
    hidden: int  # the first this many committed shards have hidden states

    @classmethod
    def of(cls, samples: int, shard_size: int) -> Layout:
        shards = math.ceil(samples / shard_size)
        mid = shards // 3
        return cls(shards, range(mid, mid + max(2, shards // 500)),
                   frozenset(range(shards - 8, shards - 4)),
                   frozenset({shards // 5, shards // 2, shards - 3}),
                   frozenset(range(shards - 2, shards)),
                   frozenset(range(7, shards, max(shards // 20, 1))), shards * 3 // 5)

    def committed(self, shard: int) -> bool:
        return shard not in self.part_way | self.parked | self.untouched


def sample(shard: int, i: int, at: float, passed: bool, worker: str) -> dict[str, Any]:
    """One generated sample with a short body and its gate verdict."""
    tokens = 900 + (shard * 131 + i * 17) % 6000 if passed else 12 + i % 20
    reasons = [] if passed else (["too_few_tokens"] if i % 3 else
                                 ["thinking_unclosed", "empty_answer"])
    answer = f"answer {shard}-{i}" if i % 97 else f"answer {i % 11}"  # a few repeat run-wide
    return {
        "id": f"{shard}-{i}", "source": {"file": "seed.jsonl", "line": shard * 256 + i},
        "messages": [{"role": "user", "content": f"q{shard}-{i}"},
                     {"role": "assistant", "content": answer}],
        "prompt_ids": [1, 2, 3, 4], "output_ids": [5, 6, 7, 8, 9, 10],
        "usage": {"prompt_tokens": 40, "completion_tokens": tokens}, "finish_reason": "stop",
        "quality": {"passed": passed, "reasons": reasons,
                    "details": [f"turn 1: {r}" for r in reasons],
                    "supervised_tokens": [tokens], "thinking_tokens": [tokens // 2],
                    "answer_hash": answer_hash([answer]),
                    "judged_at": at},
        "written": {"worker": worker, "at": at, "wall_s": SHARD_S / 4},
    }


def write_run(storage: Storage, samples: int, shard_size: int) -> Layout:
    """Write the run into ``storage``; returns which shard is in which state."""
    layout = Layout.of(samples, shard_size)
    config = RunConfig(run=RUN, model="seed-model", input="seed.jsonl", format="jsonl",
                       prompt_field=None, shard_size=shard_size, limit=None, gates=GATES)
    storage.put_once(keys.run_config(RUN), dumps(config.to_json()))
    sizes = [min(shard_size, samples - s * shard_size) for s in range(layout.shards)]
    checked = 0
    answers: set[str] = set()
    for shard, size in enumerate(sizes):
        rows = [{"id": f"{shard}-{i}", "messages": [{"role": "user", "content": f"q{i}"}]}
                for i in range(size)]
        storage.put_once(keys.input_shard(RUN, shard), encode_jsonl_zst(rows))
        if shard in layout.untouched:
            continue
        checked += _write_shard(storage, layout, shard, size, answers)
        if shard == layout.degenerate.stop - 1:
            _gate_events(storage, checked)
    manifest = InputManifest(shards=layout.shards, rows=samples, rejected=0, shard_rows=sizes)
    storage.put_once(keys.inputs_manifest(RUN), dumps(manifest.to_json()))
    for shard in range(layout.hidden):
        if layout.committed(shard):
            storage.put_once(keys.hidden_commit(RUN, shard), dumps({"shard": shard}))
    return layout


def _write_shard(storage: Storage, layout: Layout, shard: int, size: int,
                 answers: set[str]) -> int:
    """A shard's flushes (all of them, or some if it never finished); returns samples judged."""
    worker = f"gpu-{shard % 8}"
    parts = ShardParts(storage, ShardTask(RUN, shard))
    flushes = math.ceil(size / PART)
    if not layout.committed(shard):
        flushes = max(flushes // 2, 1)
    rate = 0.6 if shard in layout.degenerate else 0.03
    judged = 0
    for flush in range(flushes):
        at = round(T0 + shard * SHARD_S + flush * SHARD_S / 4, 6)
        batch = [sample(shard, i, at, (i * 7919 + shard) % 1000 >= rate * 1000, worker)
                 for i in range(flush * PART, min((flush + 1) * PART, size))]
        for s in batch:  # the run-wide duplicate gate, as claim_answers decides it
            digest = s["quality"]["answer_hash"]
            if s["quality"]["passed"] and digest in answers:
                s["quality"].update(passed=False, reasons=["duplicate"],
                                    details=["same answer as an earlier sample"])
            elif s["quality"]["passed"]:
                answers.add(digest)
        judged += len(batch)
        for rejected in (False, True):
            chosen = [s for s in batch if s["quality"]["passed"] != rejected]
            if chosen:
                parts.write(chosen, rejected=rejected)
        if shard in layout.redelivered and flush == 0:  # a second attempt wrote it again
            again = ShardParts(storage, ShardTask(RUN, shard))
            later = [{**s, "quality": {**s["quality"], "judged_at": at + 1.0}}
                     for s in batch[:8] if s["quality"]["passed"]]
            again.write(later)
    if layout.committed(shard):
        parts.commit([f"{shard}-{i}" for i in range(size)], worker)
    return judged


def _gate_events(storage: Storage, checked: int) -> None:
    """The pause the degenerate stretch caused, its acceptance, and new thresholds later."""
    at = T0 + 1.0
    pause = {"reason": "rejection rate 60% over the last 200 samples exceeds the 20% threshold",
             "examples": [], "at": at, "checked": checked, "rejected": int(checked * 0.05),
             "reasons": {"too_few_tokens": 1}, "window": None}
    stamp = "20251124T000000.000000-aaaaaa"
    storage.put_once(keys.gate_event(RUN, "pause", stamp), dumps(pause))
    resume = {"accepted": True, "at": at + 60, "checked": checked, "max_reject_rate": 0.2,
              "pause_after": 200, "lifted": pause["reason"]}
    storage.put_once(keys.gate_event(RUN, "resume", stamp.replace("00.0", "10.0")),
                     dumps(resume))
    later = {**resume, "accepted": False, "max_reject_rate": 0.25, "lifted": None}
    storage.put_once(keys.gate_event(RUN, "resume", stamp.replace("00.0", "20.0")),
                     dumps(later))

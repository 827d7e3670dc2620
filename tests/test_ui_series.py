"""The dashboard's series from stored parts and commits."""

from __future__ import annotations

from pathlib import Path

from common import keys
from common.gates.partstats import SampleStat, part_stats
from common.runs.checkpoints import Ledger
from common.runs.records import ShardCommit, dumps, encode_jsonl_zst
from common.storage import open_storage
from producer.ui.series import SeriesReader, build_series


def _sample(i: int, tokens: int, at: float, worker: str = "w1", wall: float = 10.0) -> dict:
    return {"id": str(i), "usage": {"completion_tokens": tokens},
            "quality": {"passed": True, "reasons": [], "judged_at": at},
            "written": {"worker": worker, "at": at, "wall_s": wall}}


def test_tokens_spread_over_each_parts_wall_time() -> None:
    entries = [{"worker": "a", "at": 1000.0, "wall_s": 10.0, "samples": 2, "rejected": 0,
                "tokens": 100},
               {"worker": "b", "at": 1010.0, "wall_s": 10.0, "samples": 2, "rejected": 1,
                "tokens": 300}]
    series = build_series(entries)
    assert series["bucket_s"] == 5 and series["t"] == [990, 995, 1000, 1005, 1010]
    assert series["samples_done"] == [0, 0, 2, 2, 4]
    assert series["tokens_per_s"][:2] == [10.0, 10.0]  # part a: 100 tokens over 10 s
    assert series["workers"]["b"][2:4] == [30.0, 30.0]
    assert series["rejection_rate"] == [None, None, 0.0, None, 0.5]
    assert series["totals"] == {"parts": 2, "samples": 4, "rejected": 1, "tokens": 400}
    # A longer run keeps under MAX_BUCKETS points with a round bucket.
    long = build_series([{**entries[0], "at": 1000.0 + 86400 * 7}, entries[0]])
    assert long["bucket_s"] == 3600 and len(long["t"]) <= 240


def test_part_stats_count_canonical_copies_once() -> None:
    first = [SampleStat.of(_sample(i, 10, 100.0)) for i in range(3)]
    again = [SampleStat.of(_sample(i, 10, 200.0, worker="w2")) for i in range(2, 5)]
    stats = part_stats({"runs/r/generated/shard-000000/part-0000.jsonl.zst": first,
                        "runs/r/generated/shard-000000/part-0001.jsonl.zst": again},
                       keys.generated_prefix("r"))
    assert [s["samples"] for s in stats.values()] == [3, 2]
    assert [s["tokens"] for s in stats.values()] == [30, 30]
    assert [s["worker"] for s in stats.values()] == ["w1", "w2"]


def test_series_reads_parts_then_the_commits(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    run = "r"
    storage.put_once(keys.run_config(run), b"{}")
    part = keys.generated_part(run, 0, 0)
    storage.put_once(part, encode_jsonl_zst([_sample(i, 50, 1000.0) for i in range(4)]))
    reader = SeriesReader(storage, run)
    assert reader.read()["totals"]["parts"] == 0   # committed data only, unless asked live
    live = reader.read(live=True)
    assert live["totals"] == {"parts": 1, "samples": 4, "rejected": 0, "tokens": 200}
    commit = ShardCommit(run, 0, [part], [str(i) for i in range(4)], {}, {}, "w1",
                         part_stats={part: {"worker": "w1", "at": 1000.0, "wall_s": 10.0,
                                            "samples": 4, "rejected": 0, "tokens": 200}})
    storage.put_once(keys.generated_commit(run, 0), dumps(commit.to_json()))
    other = keys.generated_part(run, 1, 0)
    second = ShardCommit(run, 1, [other], [str(i) for i in range(4, 8)], {}, {}, "w2",
                         part_stats={other: {"worker": "w2", "at": 1100.0, "wall_s": 5.0,
                                             "samples": 4, "rejected": 0, "tokens": 70}})
    storage.put_once(keys.generated_commit(run, 1), dumps(second.to_json()))
    series = reader.read(live=True)
    assert reader.parts == {}  # the commit's summary replaced the part read before it
    assert series["totals"] == {"parts": 2, "samples": 8, "rejected": 0, "tokens": 270}
    assert series["samples_done"][-1] == 8
    assert SeriesReader(storage, run).read() == series


def test_training_metrics_over_steps_from_checkpoints(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    for step, loss, extra in ((50, "3.5", {}), (100, "2.25", {"tau": "2.5"})):
        metrics = {"step": str(step), "loss": loss, "slot1_accuracy": "0.4",
                   "slot_accuracy": "[0.4, 0.2]", "acceptance_length": "1.6", **extra}
        storage.put_once(keys.drafter_checkpoint("r", step, "_COMMIT.json"),
                         dumps({"step": step, "seq": 0, "metrics": metrics,
                                "ledger": Ledger().to_json()}))
    train = SeriesReader(storage, "r").read()["train"]
    assert train["step"] == [50, 100] and train["loss"] == [3.5, 2.25]
    assert train["tau"] == [None, 2.5] and train["slot2_accuracy"] == [0.2, 0.2]

"""The read paths as they were before commit summaries, for ``seed_scale.py`` to compare with.

Each is the earlier code, verbatim where it still fits: commits read one GET at a time and
kept whole, every uncommitted part read in series, report and export reading in series. The
monitor's old rebuild is still in the project (:mod:`embedded.reference_monitor`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from common import keys
from common.gates.partstats import SampleStat, part_stats
from common.runs.commit_cache import CommitDigest
from common.runs.records import ShardCommit, decode_jsonl_zst
from common.runs.store import RunStore
from common.storage import Storage
from producer.status import StatusReader
from producer.ui.series import SeriesReader, _commit_entries


def serial_fetch(storage: Storage, names: Iterable[str], threads: int = 1) -> Iterator[
        tuple[str, bytes]]:
    """One GET after the other, as every reader did."""
    for name in names:
        yield name, storage.get(name)


def serial_commits(storage: Storage, names: Iterable[str], threads: int = 1) -> Iterator[
        ShardCommit]:
    import json

    for _, data in serial_fetch(storage, names):
        yield ShardCommit.from_json(json.loads(data))


class LegacyStatusReader(StatusReader):
    """``status`` reading each new commit with its own GET, in series, kept whole."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.whole: dict[int, ShardCommit] = {}

    def read(self) -> dict[str, Any]:
        self.fixed.clear()  # run.json and the manifest were read on every call
        return super().read()

    def _read_commits(self, total: int) -> list[str]:
        part_keys = []
        for key in self.storage.list(keys.generated_prefix(self.run)):
            shard = keys.shard_of(key)
            if key.endswith("/_COMMIT.json") and shard is not None and shard not in self.commits:
                self.whole[shard] = RunStore(self.storage, self.run).commit(shard)
                self.commits[shard] = CommitDigest.of(self.whole[shard])
            elif keys.part_number(key) is not None:
                part_keys.append(key)
        return part_keys + [k for k in self.storage.list(keys.rejected_prefix(self.run))
                            if keys.part_number(k) is not None]


class LegacySeriesReader(SeriesReader):
    """The series reading each commit and each uncommitted part with its own GET."""

    def _entries(self) -> list[dict[str, Any]]:
        import json

        generated = keys.generated_prefix(self.run)
        found: dict[int, list[str]] = defaultdict(list)
        for prefix in (generated, keys.rejected_prefix(self.run)):
            for key in self.storage.list(prefix):
                shard = keys.shard_of(key)
                if shard is None or shard in self.committed:
                    continue
                if key.endswith("/_COMMIT.json") and key.startswith(generated):
                    commit = ShardCommit.from_json(json.loads(self.storage.get(key)))
                    self.committed[shard] = _commit_entries(CommitDigest.of(commit))
                elif keys.part_number(key) is not None:
                    found[shard].append(key)
        entries = [e for shard_entries in self.committed.values() for e in shard_entries]
        for shard, part_keys in found.items():
            if shard in self.committed:
                continue
            for key in part_keys:
                if key not in self.parts:
                    self.parts[key] = [SampleStat.of(s)
                                       for s in decode_jsonl_zst(self.storage.get(key))]
            known = {k: self.parts[k] for k in part_keys}
            entries += [{"shard": shard, **stats}
                        for stats in part_stats(known, generated).values()]
        return entries


def install() -> None:
    """Route status, the dashboard, report and export through the earlier read paths."""
    import producer.dataset_export
    import producer.report
    import producer.status
    import producer.ui.views

    producer.status.fetch = serial_fetch
    producer.report.fetch = serial_fetch
    producer.dataset_export.fetch = serial_fetch
    producer.dataset_export.read_commits = serial_commits
    producer.ui.views.StatusReader = LegacyStatusReader
    producer.ui.views.SeriesReader = LegacySeriesReader

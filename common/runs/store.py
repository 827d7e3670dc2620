"""Every stored record of a run, read one way: ``RunStore(storage, run).config()`` and the like.

A missing ``run.json`` is one error everywhere (:class:`common.errors.RunNotFound`, a
``ConfigError``: the CLI prints it and exits 1, a worker parks the shard). Torch-free, so
``status`` and ``resume`` stay light.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common import keys
from common.errors import NotFound, NotReady, RunNotFound
from common.runs.commit_set import committed_shards
from common.runs.records import InputManifest, RunConfig, ShardCommit, decode_jsonl_zst
from common.runs.trainrows import TrainingRow, training_rows
from common.storage import Storage


@dataclass(frozen=True)
class RunStore:
    """One run's objects in storage."""

    storage: Storage
    run: str

    def _json(self, key: str) -> Any:
        return json.loads(self.storage.get(key))

    def config_or_none(self) -> RunConfig | None:
        try:
            return RunConfig.from_json(self._json(keys.run_config(self.run)))
        except NotFound:
            return None

    def config(self) -> RunConfig:
        config = self.config_or_none()
        if config is None:
            raise self.missing()
        return config

    def missing(self) -> RunNotFound:
        """The one error every command and the dashboard give for a run that is not there."""
        return RunNotFound(f"run {self.run!r} not found in {self.storage.root} (no run.json)")

    def manifest(self) -> InputManifest | None:
        """The inputs manifest; None while enqueue has not finished reading the input."""
        try:
            return InputManifest.from_json(self._json(keys.inputs_manifest(self.run)))
        except NotFound:
            return None

    def commit(self, shard: int) -> ShardCommit:
        """A shard's generate commit; :class:`NotReady` before it is written."""
        try:
            return ShardCommit.from_json(self._json(keys.generated_commit(self.run, shard)))
        except NotFound as exc:
            raise NotReady(f"shard {shard} of run {self.run} is not committed yet") from exc

    def committed(self, stage: str = "generate") -> set[int]:
        """Shards whose ``stage`` (generate or hidden) commit exists (see the run index)."""
        return committed_shards(self.storage, self.run, stage)

    def row_lengths(self, shard: int) -> list[tuple[int, int]]:
        """Each accepted training row's (tokens, generated tokens): from the commit where it
        says (one object), else from the parts it names."""
        commit = self.commit(shard)
        stated = commit.stats.get("rows")
        if isinstance(stated, list):
            return [(int(t), int(g)) for t, g in stated]
        return [(len(r.input_ids), r.supervised_tokens) for r in self.training_rows(shard)]

    def training_rows(self, shard: int) -> list[TrainingRow]:
        """Every accepted sample's rows once, in a fixed order, from the parts its commit names."""
        commit = self.commit(shard)
        wanted = set(commit.sample_ids)
        rows: list[TrainingRow] = []
        for part in sorted({commit.part_of[i] for i in wanted}):
            for sample in decode_jsonl_zst(self.storage.get(part)):
                if sample["id"] in wanted and commit.part_of[sample["id"]] == part:
                    rows.extend(training_rows(sample))
        return rows

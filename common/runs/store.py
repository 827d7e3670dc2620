"""Every stored record of a run, read one way: ``RunStore(storage, run).config()`` and the like.

A missing ``run.json`` is one error everywhere (:class:`common.errors.RunNotFound`, a
``ConfigError``: the CLI prints it and exits 1, a worker parks the shard); one that is not a run
config is :class:`common.errors.ForeignObject`, the same way. Every read is bounded and typed
(:mod:`common.reads`): a foreign manifest reads as not there yet, a foreign part is left out.
Torch-free, so ``status`` and ``resume`` stay light.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from common import keys
from common.choices import RowKind
from common.errors import ForeignObject, NotFound, NotReady, RunNotFound
from common.reads import limits_of, note, read_bytes, read_record, read_rows
from common.row_caps import RowCaps, row_caps
from common.runs.commit_set import committed_shards
from common.runs.index_objects import read_commit
from common.runs.records import InputManifest, RunConfig, ShardCommit
from common.runs.schemas import MANIFEST, RUN_JSON, SAMPLE
from common.runs.trainrows import TrainingRow, has_token_ids, training_rows
from common.storage import Storage


@dataclass(frozen=True)
class RunStore:
    """One run's objects in storage."""

    storage: Storage
    run: str

    def config_or_none(self) -> RunConfig | None:
        """run.json, None where it is not there; :class:`ForeignObject` where it is no run
        config (bounded, typed, then built)."""
        key = keys.run_config(self.run)
        try:
            data = read_record(self.storage, key, RUN_JSON)
        except NotFound:
            return None
        try:
            return RunConfig.from_json(data)
        except (TypeError, ValueError, KeyError) as exc:
            raise ForeignObject(key, f"not a run config ({type(exc).__name__}: {exc})") \
                from None

    def config(self) -> RunConfig:
        config = self.config_or_none()
        if config is None:
            raise self.missing()
        return config

    def missing(self) -> RunNotFound:
        """The one error every command and the dashboard give for a run that is not there."""
        return RunNotFound(f"run {self.run!r} not found in {self.storage.root} (no run.json)")

    def manifest(self) -> InputManifest | None:
        """The inputs manifest; None while enqueue has not finished reading the input (or where
        the object there is foreign: noted)."""
        try:
            return InputManifest.from_json(read_record(
                self.storage, keys.inputs_manifest(self.run), MANIFEST))
        except NotFound:
            return None
        except ForeignObject as exc:
            note(exc)
            return None

    def commit(self, shard: int) -> ShardCommit:
        """A shard's generate commit; :class:`NotReady` before it is written,
        :class:`ForeignObject` where the object there is not one of its shard's
        (:mod:`common.runs.commit_proof`)."""
        key = keys.generated_commit(self.run, shard)
        try:
            data = read_bytes(self.storage, key, limits_of(self.storage).json_bytes)
        except NotFound as exc:
            raise NotReady(f"shard {shard} of run {self.run} is not committed yet") from exc
        # Proven against the run: its shard's, within the manifest, its own parts only.
        return ShardCommit.from_json(read_commit(self.storage, key, data))

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
        for part in sorted({commit.part_of[i] for i in wanted if i in commit.part_of}):
            for sample in self.part_rows(part):
                if sample["id"] not in wanted or commit.part_of.get(sample["id"]) != part:
                    continue
                if not has_token_ids(sample):   # schema-valid, yet nothing to train on
                    note(ForeignObject(part, f"sample {sample['id'][:80]!r} has no token ids"))
                    continue
                rows.extend(training_rows(dict(sample)))
        return rows

    @functools.cached_property
    def sample_caps(self) -> RowCaps:
        """The caps on one of the run's parts (:mod:`common.row_caps`), from its run.json; the
        defaults where that is not there or foreign."""
        try:
            config = self.config_or_none()
        except ForeignObject as exc:
            note(exc)
            config = None
        return row_caps(RowKind.SAMPLES, config, limits_of(self.storage))

    def part_rows(self, part: str) -> list[Any]:
        """A part's samples, bounded and typed; none where the part is foreign (noted: its
        samples are missing, never a reader's failure)."""
        try:
            return read_rows(self.storage, part, SAMPLE, self.sample_caps)
        except ForeignObject as exc:
            note(exc)
            return []

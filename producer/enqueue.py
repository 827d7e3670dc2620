"""Enqueue and resume: freeze the run config, stream the input into shards, queue what is missing.

Called by ``dflash-pipeline enqueue`` and ``dflash-pipeline resume``. Storage is the truth:
both commands derive what to queue from it alone, so they work after Redis was wiped and
queue nothing for a finished run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from common import keys
from common.drafter.origin import DrafterSummary
from common.errors import BadRow
from common.inputs.rows import IdRegistry
from common.queue.celery_app import GENERATE
from common.queue.dispatch import publish_shard
from common.queue.reconcile import Flags, reconcile, reconcile_run, waiting_messages
from common.queue.shard_registry import watch_run
from common.runs.intake import Intake, Item, RowCheck
from common.runs.records import InputManifest, RunConfig, dumps, encode_jsonl_zst
from common.runs.splits import HeldoutPicker
from common.runs.store import RunStore
from common.storage import Storage

log = logging.getLogger(__name__)

REJECTED_CHUNK = 10_000
PROGRESS_EVERY_SHARDS = 100  # a line on stderr per this many shards, for long inputs


@dataclass
class EnqueueReport:
    """What an enqueue or resume did, for the CLI to print (and ``--json``)."""

    run: str
    shards: int = 0
    rows: int = 0
    rejected: int = 0
    enqueued: int = 0
    committed: int = 0
    downstream: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)
    unused: dict[str, dict[str, Any]] = field(default_factory=dict)
    wrote_inputs: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)   # each value and its source
    drafter: DrafterSummary | None = None   # the frozen drafter shape's source, if any
    dry_run: bool = False   # resume --dry-run: "queued" says what would have been

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def read_run_config(storage: Storage, run: str) -> RunConfig | None:
    return RunStore(storage, run).config_or_none()


def freeze_run_config(storage: Storage, config: RunConfig) -> RunConfig:
    """Write run.json once; a run id reused with other settings raises RunConfigMismatch."""
    existing = read_run_config(storage, config.run)
    if existing is None and storage.put_once(keys.run_config(config.run), dumps(config.to_json())):
        return config
    existing = existing or read_run_config(storage, config.run)
    assert existing is not None  # put_once said it exists
    existing.check_same(config)
    return existing


def read_manifest(storage: Storage, run: str) -> InputManifest | None:
    return RunStore(storage, run).manifest()


class TaskSender:
    """Queues ``generate`` tasks, skipping shards that are committed or already queued."""

    def __init__(self, storage: Storage, app: Celery, client: redis.Redis, run: str) -> None:
        self.storage, self.app, self.client, self.run = storage, app, client, run
        self.committed = RunStore(storage, run).committed("generate")
        self.enqueued = 0
        watch_run(client, run)  # where the reconciler looks for shards to heal

    def send(self, shard: int) -> bool:
        registry = GENERATE.registry(self.client, self.run)
        # The marker makes a repeated enqueue idempotent; the worker clears it when it starts.
        if shard in self.committed or registry.is_queued(shard):
            return False
        fresh = registry.is_parked(shard)
        publish_shard(self.app, self.client, GENERATE, self.run, shard, fresh=fresh)
        self.enqueued += 1
        return True


@dataclass
class Tally:
    """Counts rows and rejections and checks ids, the same for enqueue and ``--dry-run``."""

    rows: int = 0
    rejected: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    ids: IdRegistry = field(default_factory=IdRegistry)

    def judge(self, item: Item) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """``(row, None)`` for a good row, ``(None, rejection record)`` for a bad one."""
        self.rows += 1
        row, error = item.row, item.error
        if row is not None:
            try:
                self.ids.check_and_add(row["id"])
            except BadRow as bad:
                row, error = None, str(bad)
        if row is not None:
            return row, None
        self.rejected += 1
        bad_row = {**item.where, "reason": error}
        if len(self.examples) < 20:
            self.examples.append(bad_row)
        return None, bad_row


def write_inputs(
    storage: Storage, config: RunConfig, on_shard: Callable[[int], object],
    check: RowCheck | None = None, intake: Intake | None = None,
) -> InputManifest:
    """Stream the input into put-once shards; bad rows go to the rejected area with reasons.

    ``check`` may reject a well-formed row too (e.g. a prompt that cannot fit the context).
    """
    tally = Tally()
    shard_rows: list[int] = []
    buffer: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    heldout = HeldoutPicker(config.heldout_fraction, config.heldout_min)

    def flush_shard() -> None:
        shard = len(shard_rows)
        storage.put_once(keys.input_shard(config.run, shard), encode_jsonl_zst(buffer))
        shard_rows.append(len(buffer))
        buffer.clear()
        on_shard(shard)
        if shard % PROGRESS_EVERY_SHARDS == PROGRESS_EVERY_SHARDS - 1:
            log.info("run %s: %d rows read, %d shards written so far", config.run, tally.rows,
                     shard + 1)

    def flush_rejected() -> None:
        chunk = (tally.rejected - 1) // REJECTED_CHUNK
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejected)
        storage.put_once(keys.rejected_input_rows(config.run, chunk), body.encode())
        rejected.clear()

    intake = intake or Intake(config, check)
    for item in intake.started():
        row, bad_row = tally.judge(item)
        if bad_row is not None:
            rejected.append(bad_row)
            if len(rejected) == REJECTED_CHUNK:
                flush_rejected()
            continue
        if row is None:   # judge gives a row or a rejection, never neither
            continue
        buffer.append(row)
        heldout.add(row["id"], len(shard_rows))
        if len(buffer) == config.shard_size:
            flush_shard()
    if buffer:
        flush_shard()
    if rejected:
        flush_rejected()
    manifest = InputManifest(
        shards=len(shard_rows), rows=tally.rows, rejected=tally.rejected, shard_rows=shard_rows,
        examples=tally.examples, layouts=intake.layout_summary(), unused=intake.unused,
        heldout=heldout.picked(),
    )
    storage.put_once(keys.inputs_manifest(config.run), dumps(manifest.to_json()))
    return manifest


def enqueue_run(
    storage: Storage, app: Celery, client: redis.Redis, config: RunConfig,
    check: RowCheck | None = None,
) -> EnqueueReport:
    """Freeze the config, write the input shards unless already written, queue missing shards."""
    intake = None
    if read_manifest(storage, config.run) is None:
        intake = Intake(config, check)
        intake.started()  # an empty input is refused here, before run.json is written
    config = freeze_run_config(storage, config)
    sender = TaskSender(storage, app, client, config.run)
    report = EnqueueReport(run=config.run)
    manifest = read_manifest(storage, config.run)
    if manifest is None:
        log.info("run %s: reading %s", config.run, ", ".join(config.inputs))
        manifest = write_inputs(storage, config, on_shard=sender.send, check=check,
                                intake=intake)
        report.wrote_inputs = True
    else:
        for shard in range(manifest.shards):
            sender.send(shard)
    return _fill(report, manifest, sender)


def resume_run(
    storage: Storage, app: Celery, client: redis.Redis, run: str, force: bool = False,
    check_for: Callable[[RunConfig], RowCheck | None] = lambda config: None,
    lease_ttl: float = 60.0, dry_run: bool = False,
) -> EnqueueReport:
    """One reconciler pass over the run, parked shards included: storage alone says what is due.

    ``force`` queues shards even if a task for them is queued already (their marker is ignored);
    ``dry_run`` says what it would queue and writes nothing (no Redis key, no object).
    """
    store = RunStore(storage, run)
    config, manifest = store.config(), store.manifest()
    flags = Flags(force=force, parked=True, leases=False, dry_run=dry_run)
    if manifest is None:
        if dry_run:   # enqueue must finish reading the input first: nothing else is due
            return EnqueueReport(run=run, dry_run=True)
        # enqueue died while reading the input: finish that first, exactly as enqueue would.
        return enqueue_run(storage, app, client, config, check_for(config))
    if dry_run:
        sent = reconcile_run(storage, app, client, run, lease_ttl, waiting_messages(client),
                             flags) or []
    else:
        watch_run(client, run)
        done = reconcile(storage, app, client, lease_ttl, runs=[run], flags=flags,
                         wait_s=max(2 * lease_ttl, 10.0) + 5)
        sent = (done or {}).get(run) or []
    report = EnqueueReport(run=run, dry_run=dry_run)
    report.shards, report.rows, report.rejected = manifest.shards, manifest.rows, manifest.rejected
    report.enqueued = sum(stage == GENERATE.name for stage, _ in sent)
    report.downstream = len(sent) - report.enqueued
    report.committed = len(store.committed("generate"))
    report.examples, report.layouts, report.unused = (manifest.examples, manifest.layouts,
                                                      manifest.unused)
    return report


def _fill(report: EnqueueReport, manifest: InputManifest, sender: TaskSender) -> EnqueueReport:
    report.shards, report.rows, report.rejected = manifest.shards, manifest.rows, manifest.rejected
    report.enqueued, report.committed = sender.enqueued, len(sender.committed)
    report.examples = report.examples or manifest.examples
    report.layouts, report.unused = manifest.layouts, manifest.unused
    return report

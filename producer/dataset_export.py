"""``dflash-pipeline export-dataset``: a run's regenerated samples, out of the pipeline.

    dflash-pipeline export-dataset --run RUN --out DIR|s3://bucket/prefix \\
        --format parquet|specforge|messages|speculators [--include-rejected] \\
        [--shard-rows 100000] [--split-heldout] [--json]

Reads only committed shards and only the canonical copy of each sample (the commit's
``sample_ids``; ``--include-rejected`` adds ``rejected_ids`` with their reasons). Files are the
Hugging Face layout, ``data/<split>-00000-of-000NN.<ext>``, each a put-once object written from
a local temporary file (memory stays bounded); ``_EXPORT.json`` is written last and lists them,
so an interrupted export is simply run again (files already there are skipped, the same bytes
are produced for the rest) and a finished one writes nothing the second time.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from common import keys
from common.choices import EnumChoice, ExportFormat
from common.cli import common_options, options_for
from common.config import Settings
from common.declared import opt
from common.errors import ConfigError, ForeignObject
from common.faults import inject
from common.reads import note, part_getter, rows_or_none
from common.runs.commit_cache import fetch, read_commits
from common.runs.records import ShardCommit, dumps
from common.runs.schemas import SAMPLE, Sample
from common.runs.splits import is_heldout
from common.runs.store import RunStore
from common.storage import Storage, open_storage
from producer.dataset_card import dataset_card
from producer.export_formats import EXTENSIONS, FORMATS, FileWriter, rows_of, unexportable

log = logging.getLogger(__name__)

MANIFEST = "_EXPORT.json"
CARD = "README.md"


@dataclass(frozen=True)
class ExportOptions:
    """What decides an export's files; a second export to the same place must match them."""

    run: str
    format: ExportFormat
    include_rejected: bool = False
    shard_rows: int = 100_000
    split_heldout: bool = False

    def __post_init__(self) -> None:
        try:   # a member however it came (the option, a caller's text)
            object.__setattr__(self, "format", ExportFormat(self.format))
        except ValueError:
            raise ConfigError(f"unknown format {self.format!r}; choose one of "
                              f"{', '.join(FORMATS)}") from None
        if self.shard_rows < 1:
            raise ConfigError(f"--shard-rows must be positive, not {self.shard_rows}")


@dataclass
class ExportReport:
    """What an export did: samples and files per split, bytes, files written now."""

    out: str
    options: ExportOptions
    samples: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    shards: list[int] = field(default_factory=list)
    written: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"out": self.out, **asdict(self.options), "samples": self.samples,
                "files": self.files, "shards": self.shards, "written": self.written,
                "bytes": self.bytes,
                "seconds": round(self.seconds, 2)}


def split_of(sample_id: str, options: ExportOptions, held: frozenset[str] | None) -> str:
    """``held``: the run's frozen held-out ids (None for runs enqueued before the split)."""
    if not options.split_heldout:
        return "train"
    return "heldout" if (sample_id in held if held is not None else is_heldout(sample_id)) \
        else "train"


def planned(commits: list[ShardCommit], options: ExportOptions
            ) -> list[tuple[ShardCommit, list[str]]]:
    """Every exported sample id, shard by shard, in a fixed order."""
    return [(c, c.sample_ids + (c.rejected_ids if options.include_rejected else []))
            for c in commits]


def file_key(split: str, index: int, count: int, fmt: ExportFormat) -> str:
    return f"data/{split}-{index:05d}-of-{count:05d}.{EXTENSIONS[fmt]}"


def export_dataset(source: Storage, out: Storage, options: ExportOptions,
                   progress: Any = None) -> ExportReport:
    """Write the export (or nothing, when it is already complete); see the module docstring."""
    started = time.monotonic()
    store = RunStore(source, options.run)
    config = store.config()
    report = ExportReport(out=out.root, options=options)
    committed = sorted(store.committed())
    done = _finished(out, options, committed)
    if done is not None:
        report.samples, report.files, report.bytes = done["samples"], done["files"], done["bytes"]
        report.shards = done["shards"]
        return report
    manifest = store.manifest()
    if manifest is None or len(committed) < manifest.shards:
        log.warning("run %s: %d of %s shards committed; the export holds those only",
                    options.run, len(committed), manifest.shards if manifest else "?")
    report.shards = committed
    held = manifest.heldout_ids if manifest is not None and manifest.heldout else None
    commits = list(read_commits(source, [keys.generated_commit(options.run, shard)
                                         for shard in committed]))
    order = planned(commits, options)
    counts = Counter(split_of(i, options, held) for _, ids in order for i in ids)
    files = {split: max(1, math.ceil(n / options.shard_rows)) for split, n in counts.items()}
    seen: Counter[str] = Counter()
    writers: dict[str, _Split] = {}
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        for sample in _samples(source, order, progress, options.format):
            split = split_of(sample["id"], options, held)
            index = seen[split] // options.shard_rows
            seen[split] += 1
            target = writers.setdefault(split, _Split(out, split, files[split], options,
                                                      Path(tmp)))
            target.add(index, sample)
        for target in writers.values():
            target.close()
            report.written += target.written
    # A file planned for samples that proved foreign (noted, skipped) was never written.
    report.files = [key for s, n in sorted(files.items()) for k in range(n)
                    if out.exists(key := file_key(s, k, n, options.format))]
    report.samples = dict(sorted(seen.items()))
    report.bytes = sum(out.size(k) for k in report.files)
    out.put_once(CARD, dataset_card(config, options.format, options.include_rejected,
                                      report.samples, commits).encode())
    written = {**report.to_json(), "written": None, "seconds": None}
    out.put_once(MANIFEST, dumps(written))
    report.seconds = time.monotonic() - started
    return report


def _finished(out: Storage, options: ExportOptions, committed: list[int]
              ) -> dict[str, Any] | None:
    """The manifest of a finished export of the same shards with these options, if any;
    refuses one with other options or of an earlier state of the run (exports are put-once)."""
    if not out.exists(MANIFEST):
        return None
    manifest: dict[str, Any] = json.loads(out.get(MANIFEST))
    theirs = {k: manifest.get(k) for k in asdict(options)}
    if theirs != asdict(options):
        raise ConfigError(f"{out.root} already holds an export with other options ({theirs}); "
                          "export to a new place")
    if manifest.get("shards") != committed:
        raise ConfigError(f"{out.root} holds an export of {len(manifest.get('shards') or [])} "
                          f"committed shards; the run has {len(committed)} now: export to a "
                          "new place")
    return manifest


def _samples(storage: Storage, order: list[tuple[ShardCommit, list[str]]],
             progress: Any, fmt: ExportFormat) -> Iterator[Sample]:
    """The canonical samples in the planned order, reading each shard's parts once (a bounded
    pool reads ahead, in order); one that has no row in ``fmt`` is noted, not exported."""
    plan = [(commit, ids, sorted({commit.part_of[i] for i in ids if i in commit.part_of}))
            for commit, ids in order]   # proven commits: their own shard's parts only
    fetched = fetch(storage, [part for _, _, parts in plan for part in parts],
                    get=part_getter(storage))
    caps = RunStore(storage, order[0][0].run).sample_caps if order else None
    for commit, ids, parts in plan:
        wanted = set(ids)
        found: dict[str, Sample] = {}
        for part, data in itertools.islice(fetched, len(parts)):
            for sample in rows_or_none(storage, part, SAMPLE, data, caps) or []:
                if sample["id"] not in wanted or commit.part_of.get(sample["id"]) != part:
                    continue
                if why := unexportable(sample, fmt):
                    note(ForeignObject(part, f"sample {sample['id'][:80]!r}: {why}"))
                    continue
                found[sample["id"]] = sample
        missing = [i for i in ids if i not in found]
        if missing:   # a foreign part (noted), or none named: its samples cannot be exported
            log.warning("run %s shard %d: %d samples not exported: their part is foreign or "
                        "not named",
                        commit.run, commit.shard, len(missing))
        for sample_id in ids:
            if sample_id in found:
                yield found[sample_id]
        if progress is not None:
            progress(len(ids))


class _Split:
    """The files of one split, written in order; a file already in ``out`` is not rebuilt."""

    def __init__(self, out: Storage, split: str, count: int, options: ExportOptions,
                 tmp: Path) -> None:
        self.out, self.split, self.count, self.options, self.tmp = out, split, count, options, tmp
        self.index, self.written = -1, 0
        self.writer: FileWriter | None = None
        self.skip = False

    def add(self, index: int, sample: Mapping[str, Any]) -> None:
        if index != self.index:
            self.close()
            self.index = index
            self.skip = self.out.exists(self.key)
            if not self.skip:
                inject("export.file")
                self.writer = FileWriter(self.tmp / f"{self.split}-{index}", self.options.format,
                                         self.options.include_rejected)
        if self.writer is not None:
            for row in rows_of(sample, self.options.format, self.options.include_rejected):
                self.writer.add(row)

    @property
    def key(self) -> str:
        return file_key(self.split, self.index, self.count, self.options.format)

    def close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        self.written += self.out.put_file_once(self.key, self.writer.path)
        self.writer.path.unlink()
        self.writer = None


@dataclass(frozen=True, kw_only=True)
class ExportDatasetOptions:
    """``export-dataset``'s own options."""

    out: str = opt(
        required=True, commands=("export-dataset",),
        help="Where to write: a local directory or s3://bucket/prefix.")
    fmt: ExportFormat = opt(
        required=True,
        decls=("--format",),
        commands=("export-dataset",),
        type=EnumChoice(ExportFormat),
        help="parquet (Hugging Face datasets), specforge, messages (OpenAI style) or "
             "speculators (input_ids + loss_mask per assistant turn).")
    include_rejected: bool = opt(
        False, commands=("export-dataset",), is_flag=True,
        help="Also export samples the quality gates rejected, with their reasons.")
    shard_rows: int = opt(
        ExportOptions.shard_rows, commands=("export-dataset",), type=click.IntRange(min=1),
        help="Samples per output file.")
    split_heldout: bool = opt(
        False, commands=("export-dataset",), is_flag=True,
        help="Put the run's held-out samples (never trained on) in files of their own.")


@click.command("export-dataset")
@options_for("export-dataset", ExportDatasetOptions)
@common_options
def export_dataset_command(settings: Settings, run: str, out: str, fmt: ExportFormat,
                           include_rejected: bool, shard_rows: int, split_heldout: bool,
                           as_json: bool) -> None:
    """Export a run's regenerated samples for other tools, each accepted sample exactly once."""
    from rich.console import Console
    from rich.progress import Progress

    options = ExportOptions(run=run, format=fmt, include_rejected=include_rejected,
                            shard_rows=shard_rows, split_heldout=split_heldout)
    source, target = open_storage(settings.broker.storage, settings.read), open_storage(out)
    with Progress(transient=True, disable=as_json, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"exporting {run}", total=None)
        report = export_dataset(source, target, options,
                                progress=lambda n: bar.advance(task, n))
    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
        return
    total = sum(report.samples.values())
    state = (f"{report.written} files written now" if report.written or total == 0
             else "already complete, nothing written")
    splits = ", ".join(f"{s} {n}" for s, n in report.samples.items()) or "none"
    click.echo(f"run {run}: {total} samples ({splits}) as {fmt} in {len(report.files)} files, "
               f"{report.bytes:,} bytes, to {target.root} ({state})")

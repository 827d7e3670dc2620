"""``bench --run RUN``: the run's own conversations through the engine a worker would start.

Draws ``--num`` rows from the run's input shards (seeded) and runs each conversation, every
turn, as the worker does (:mod:`producer.bench_loop`: the run's thinking mode per row, template
options, tools, sampling and ``max_new_tokens`` capped to the room the server's context leaves,
the quality gates stopping a conversation), in a closed loop at each concurrency (the worker's
own ``--max-in-flight`` among them by default), for each configuration of ``--mtp`` (off, on:
both by default where the target states an MTP head and MTP keeps the run's sampling), on an
engine started as the worker starts it (:mod:`producer.bench_engine`: the worker's own
``--max-running-requests``, its cache flushed before each level so no level reuses another's
prefixes), or on ``--engine-url``'s server as it runs. Where both configurations were measured
in a steady window, the rows are stored as the run's verdict for this GPU model, TP and engine
arguments (:mod:`common.runs.bench_verdict`, with ``DFLASH_MTP_MARGIN``), which a worker's
``--mtp auto`` follows. Then :mod:`producer.projection` turns the rates into the run's hours
left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from common import keys
from common.choices import EngineKind, MtpMode
from common.config import Settings
from common.engine.models import resolve_model_path, stop_token_ids, template_sha
from common.engine.mtp import MtpChoice, MtpWorker, decide_mtp, target_shape
from common.engine.serving import engine_command, visible_devices
from common.engine.speculative import server_algorithm
from common.errors import ConfigError, DflashError, EngineError, OptionRefused, StorageRefused
from common.reads import rows_or_none
from common.runs.bench_verdict import Decider, write_verdict
from common.runs.commit_cache import CommitDigest
from common.runs.index import RunIndex, shard_total
from common.runs.records import RunConfig
from common.runs.schemas import INPUT_ROW
from common.runs.store import RunStore
from common.storage import Storage, open_storage
from producer.bench import BenchRow
from producer.bench_engine import free_port, launched
from producer.bench_loop import Conversations, run_loop
from producer.projection import Projection, project

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 60   # seconds SGLang may wait for running requests before it flushes


@dataclass(frozen=True)
class BenchResult:
    rows: list[BenchRow]
    projection: Projection
    verdict: str | None = None   # the stored verdict's key (None: not stored, see ``note``)
    note: str = ""


def draw_rows(storage: Storage, run: str, num: int, seed: int) -> list[dict[str, Any]]:
    """``num`` rows (fewer if the run has fewer) from its input shards, in a seeded order."""
    shards = [k for k in storage.list(keys.inputs_prefix(run))
              if k.rsplit("/", 1)[-1].startswith("shard-")]
    if not shards:
        raise ConfigError(f"run {run!r} has no input shards yet")
    rng = random.Random(seed)
    rng.shuffle(shards)
    rows: list[dict[str, Any]] = []
    for key in shards:   # a few shards at least, so one shard's topic does not decide
        rows += [dict(r) for r in rows_or_none(storage, key, INPUT_ROW) or []]   # foreign: none
        if len(rows) >= 2 * num:
            break
    rng.shuffle(rows)
    return rows[:num]


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DflashError(f"cannot read {url}: {exc}") from exc


def server_context(url: str) -> int | None:
    """The server's context length (``/v1/models``' ``max_model_len``), None where unstated."""
    models = _get(f"{url}/v1/models").get("data") or [{}]
    context = models[0].get("max_model_len") if isinstance(models[0], dict) else None
    return context if isinstance(context, int) else None


def configurations(settings: Settings, modes: Sequence[MtpMode] | None, shape: Any,
                   config: RunConfig) -> dict[MtpMode, MtpChoice]:
    """The MTP choice of each configuration to measure, as the worker's decision
    (:func:`decide_mtp`) forced each way makes it; OptionRefused for one that cannot run."""
    asked = modes is not None
    choices: dict[MtpMode, MtpChoice] = {}
    for mode in modes or [MtpMode.OFF, MtpMode.ON]:
        try:
            worker = MtpWorker.of(settings.replace(mtp=mode), shape)
        except OptionRefused:
            if asked:
                raise
            continue
        if worker.user_algorithm is not None:
            if asked:
                raise OptionRefused("DFLASH_ENGINE_ARGS sets its own --speculative-algorithm: "
                                    "bench measures it as given (drop --mtp)")
            return {MtpMode.ON: worker.start()}
        try:
            choice = decide_mtp(worker, config.run, config.sampling, None,
                                settings.generate.max_in_flight,
                                settings.generate.engine_args, os.environ)
        except ConfigError as exc:   # --mtp on would not keep the run's sampling
            if asked:
                raise OptionRefused(str(exc).removeprefix(f"run {config.run}: ")) from exc
            continue
        if choice.on == (mode is MtpMode.ON):
            choices[mode] = choice
    return choices


def committed(storage: Storage, run: str) -> tuple[int, int]:
    """(samples, output tokens) of the run's committed shards, from its index and commits."""
    index = RunIndex(storage, run)
    for _ in index.scan(shard_total(storage, run)):
        pass
    digests = [CommitDigest.of_entry(shard, entry) for chunk in index.entries.values()
               for shard, entry in chunk.items()]
    return (sum(d.samples for d in digests),
            sum(d.stats.get("completion_tokens", 0) for d in digests))


def bench_run(settings: Settings, run: str, modes: Sequence[str] | None, levels: list[int],
              num: int, gpus: int, model: str | None = None, gpu: int | None = None,
              seed: int = 0) -> BenchResult:
    """The rows of every configuration and concurrency, the run's projection, and the stored
    verdict; ``model`` (else the run's own) is the target, ``gpu`` the first GPU of the engine
    (else all)."""
    storage = open_storage(settings.broker.storage, settings.read)
    store = RunStore(storage, run)
    config, manifest = store.config(), store.manifest()
    if manifest is None:
        raise ConfigError(f"run {run!r} is still being enqueued: its size is not known yet")
    if settings.generate.engine is not EngineKind.SGLANG and not settings.generate.engine_url:
        raise OptionRefused("bench --run measures SGLang: --engine sglang (or --engine-url)")
    model_path = resolve_model_path(settings.replace(model=model or config.model))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if config.chat_template_sha and template_sha(tokenizer.chat_template) \
            != config.chat_template_sha:
        raise ConfigError(f"{model_path}'s chat template is not the one run {run!r} froze")
    drawn = draw_rows(storage, run, num, seed)
    if not drawn:
        raise ConfigError(f"run {run!r} has no readable input rows to bench")
    work = Conversations(drawn, config, tokenizer, stop_token_ids(model_path), None)
    asked = [MtpMode(mode) for mode in modes] if modes is not None else None
    rows = _measure_all(settings, run, asked, levels, work, model_path, gpu)
    done = committed(storage, run)
    remaining = max(manifest.rows - manifest.rejected - done[0], 0)
    turns = sum(len(r["turns"]) for r in drawn) / len(drawn)
    projection = project(rows, remaining, done, turns, gpus, settings.generate.tp)
    key, note = store_verdict(storage, settings, run, rows, gpu)
    return BenchResult(rows, projection, key, note)


def _measure_all(settings: Settings, run: str, modes: list[MtpMode] | None, levels: list[int],
                 work: Conversations, model_path: Any, gpu: int | None) -> list[BenchRow]:
    """Each configuration's rows: on ``--engine-url``'s server as it runs, else on an engine
    started per configuration."""
    if settings.generate.engine_url:
        if modes is not None:
            raise OptionRefused("--mtp needs bench to start the engine; --engine-url's server "
                                "is measured as it runs")
        return _measure(settings.generate.engine_url.rstrip("/"), None, work, levels)
    rows: list[BenchRow] = []
    for mode, choice in configurations(settings, modes, target_shape(model_path),
                                       work.config).items():
        log.info("bench %s: %s", run, choice.line())
        port = free_port()   # the worker's own --max-running-requests (its --max-in-flight)
        argv = engine_command(settings, model_path, choice.args, port=port)
        gpus_env = visible_devices(gpu, settings.generate.tp) if gpu is not None else None
        with launched(argv, f"http://127.0.0.1:{port}", settings.engines_dir,
                      settings.generate.engine_startup_timeout, gpus_env) as url:
            rows += _measure(url, mode, work, levels, flush=True)
    return rows


def flush_cache(url: str) -> None:
    """Empty the engine's prefix cache (SGLang's ``/flush_cache``, once its requests are done),
    so a level does not reuse the prefixes of the one before; EngineError where it refuses."""
    request = urllib.request.Request(f"{url}/flush_cache?timeout={FLUSH_TIMEOUT_S}",
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=FLUSH_TIMEOUT_S + 30) as response:
            response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"the engine at {url} did not flush its cache between levels: "
                          f"{exc}") from exc


def _measure(url: str, mode: MtpMode | None, work: Conversations, levels: list[int],
             flush: bool = False) -> list[BenchRow]:
    """Each level's row on the server at ``url``; ``flush``: its cache emptied before each (an
    engine the bench started; a running server's is left as it is)."""
    if mode is None:   # a running server: its own flags say whether it drafts
        mode = MtpMode.ON if server_algorithm(_get(f"{url}/get_server_info")) else MtpMode.OFF
    work = replace(work, context=server_context(url))
    rows = []
    try:
        for level in levels:
            if flush:
                flush_cache(url)
            rows.append(asyncio.run(run_loop(url, level, work, mode)))
            log.info("bench %s: mtp %s at concurrency %d: %.1f output tok/s, %s", work.config.run,
                     mode.value, level, rows[-1].tokens_per_s,
                     f"steady, {rows[-1].in_flight:.1f} in flight" if rows[-1].steady
                     else "not steady (whole span)")
    except aiohttp.ClientError as exc:
        raise EngineError(f"the engine at {url} failed during the bench: {exc}") from exc
    return rows


def store_verdict(storage: Storage, settings: Settings, run: str, rows: list[BenchRow],
                  gpu: int | None) -> tuple[str | None, str]:
    """Store the rows as the run's verdict where MTP on and off were both measured on an
    engine the bench started; (its key, or None and why not)."""
    if settings.generate.engine_url:
        return None, "not stored: a server at --engine-url is measured as it runs"
    if {r.mtp for r in rows} != {MtpMode.OFF, MtpMode.ON}:
        return None, "not stored: MTP on and off were not both measured"
    decider = Decider.of(settings, gpu, dict(os.environ))
    margin = settings.generate.mtp_margin
    try:
        written = write_verdict(storage, run, decider, [r.to_json() for r in rows], margin)
    except StorageRefused as exc:
        return None, f"not stored: {exc}"
    if written is None:
        return None, ("not stored: no concurrency had a steady window with MTP on and with it "
                      "off (raise --num)")
    winners = ", ".join(f"{c}: {w}" for c, w in written[1].winners().items())
    return written[0], (f"stored for {decider.gpu}, tp {decider.tp}, engine {decider.engine}; "
                        f"winners ({margin:.0%} margin) {winners}")

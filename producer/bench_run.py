"""``bench --run RUN``: the run's own prompts through the engine a worker would start.

Draws ``--num`` rows from the run's input shards (seeded), renders each first turn with the
target's chat template as the worker does (the run's thinking mode per row, its template
options and tools), asks with the run's sampling and ``max_new_tokens`` (capped to the room the
server's context leaves), and measures each configuration of ``--mtp`` (off, on: both by default
where the target states an MTP head and MTP keeps the run's sampling) at each concurrency, on an
engine started as the worker starts it (:mod:`producer.bench_engine`), or on ``--engine-url``'s
server as it runs. Then :mod:`producer.projection` turns the rates into the run's hours left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from common import keys
from common.config import Settings
from common.engine.models import render_chat, resolve_model_path, stop_token_ids, template_sha
from common.engine.mtp import MtpChoice, choose_mtp, lossless_refusal, target_shape
from common.engine.serving import engine_command, sampling_params, visible_devices
from common.engine.speculative import server_algorithm
from common.errors import ConfigError, DflashError, EngineError, OptionRefused
from common.reads import rows_or_none
from common.runs.commit_cache import CommitDigest
from common.runs.index import RunIndex, shard_total
from common.runs.records import RunConfig
from common.runs.schemas import INPUT_ROW
from common.runs.store import RunStore
from common.storage import Storage, open_storage
from producer.bench import BenchRow, measure
from producer.bench_engine import free_port, launched
from producer.projection import Projection, project

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPrompts:
    bodies: list[dict[str, Any]]   # /generate bodies, max_new_tokens not yet fitted
    turns: float                   # mean assistant turns per drawn row


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


def run_prompts(rows: list[dict[str, Any]], config: RunConfig, tokenizer: Any,
                stop_ids: list[int]) -> RunPrompts:
    """Each row's first turn as the worker renders it, with the run's sampling."""
    bodies = []
    for row in rows:
        text = render_chat(tokenizer, list(row["turns"][0]),
                           config.sampling.thinking_for(row["id"]),
                           config.chat_template_kwargs, row.get("tools"))
        ids = tokenizer.encode(text, add_special_tokens=False)
        bodies.append({"input_ids": ids, "stream": False, "sampling_params": sampling_params(
            config.sampling, config.sampling.max_new_tokens, stop_ids)})
    turns = sum(len(r["turns"]) for r in rows) / len(rows) if rows else 1.0
    return RunPrompts(bodies, turns)


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DflashError(f"cannot read {url}: {exc}") from exc


def fitted(bodies: list[dict[str, Any]], url: str) -> list[dict[str, Any]]:
    """The bodies with ``max_new_tokens`` capped to the room the server's context leaves."""
    models = _get(f"{url}/v1/models").get("data") or [{}]
    context = models[0].get("max_model_len")
    if not isinstance(context, int):
        return bodies
    out = []
    for body in bodies:
        room = context - len(body["input_ids"])
        if room >= 1:
            params = dict(body["sampling_params"], max_new_tokens=min(
                body["sampling_params"]["max_new_tokens"], room))
            out.append({**body, "sampling_params": params})
    if not out:
        raise DflashError(f"no drawn prompt fits the server's {context}-token context")
    return out


def configurations(settings: Settings, modes: list[str] | None, shape: Any,
                   config: RunConfig) -> dict[str, MtpChoice]:
    """The MTP choice of each configuration to measure; OptionRefused for one that cannot run."""
    asked = modes is not None
    choices: dict[str, MtpChoice] = {}
    for mode in modes or ["off", "on"]:
        try:
            choice = choose_mtp(replace(settings, mtp=mode), shape)
        except OptionRefused:
            if asked:
                raise
            continue
        if choice.user_algorithm is not None:
            if asked:
                raise OptionRefused("DFLASH_ENGINE_ARGS sets its own --speculative-* flags: "
                                    "bench measures them as given (drop --mtp)")
            return {"on": choice}
        refusal = lossless_refusal(choice.algorithm, choice.device, config.sampling)
        if refusal is not None:
            if asked:
                raise OptionRefused(f"--mtp on: {refusal}")
            continue
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


def bench_run(settings: Settings, run: str, modes: list[str] | None, levels: list[int],
              num: int, gpus: int, model: str | None = None, gpu: int | None = None,
              seed: int = 0) -> tuple[list[BenchRow], Projection]:
    """The rows of every configuration and concurrency, and the run's projection; ``model``
    (else the run's own) is the target, ``gpu`` the first GPU of the engine (else all)."""
    storage = open_storage(settings.broker.storage, settings.read)
    store = RunStore(storage, run)
    config, manifest = store.config(), store.manifest()
    if manifest is None:
        raise ConfigError(f"run {run!r} is still being enqueued: its size is not known yet")
    if settings.generate.engine != "sglang" and not settings.generate.engine_url:
        raise OptionRefused("bench --run measures SGLang: --engine sglang (or --engine-url)")
    model_path = resolve_model_path(replace(settings, model=model or config.model))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if config.chat_template_sha and template_sha(tokenizer.chat_template) \
            != config.chat_template_sha:
        raise ConfigError(f"{model_path}'s chat template is not the one run {run!r} froze")
    prompts = run_prompts(draw_rows(storage, run, num, seed), config, tokenizer,
                          stop_token_ids(model_path))
    if settings.generate.engine_url:
        if modes is not None:
            raise OptionRefused("--mtp needs bench to start the engine; --engine-url's server "
                                "is measured as it runs")
        rows = _measure(settings.generate.engine_url.rstrip("/"), None, prompts, levels)
    else:
        rows = []
        for mode, choice in configurations(settings, modes, target_shape(model_path),
                                           config).items():
            log.info("bench %s: %s", run, choice.line())
            port = free_port()
            argv = engine_command(settings, model_path, choice.args, port=port,
                                  max_running_requests=max(levels))
            gpus_env = visible_devices(gpu, settings.generate.tp) if gpu is not None else None
            with launched(argv, f"http://127.0.0.1:{port}", settings.engines_dir,
                          settings.generate.engine_startup_timeout, gpus_env) as url:
                rows += _measure(url, mode, prompts, levels)
    done = committed(storage, run)
    remaining = max(manifest.rows - manifest.rejected - done[0], 0)
    return rows, project(rows, remaining, done, prompts.turns, gpus, settings.generate.tp)


def _measure(url: str, mode: str | None, prompts: RunPrompts, levels: list[int]) -> list[BenchRow]:
    bodies = fitted(prompts.bodies, url)
    if mode is None:   # a running server: its own flags say whether it drafts
        mode = "on" if server_algorithm(_get(f"{url}/get_server_info")) else "off"
    try:
        return [asyncio.run(measure(url, level, bodies, mode)) for level in levels]
    except aiohttp.ClientError as exc:
        raise EngineError(f"the engine at {url} failed during the bench: {exc}") from exc


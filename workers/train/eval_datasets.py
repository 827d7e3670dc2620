"""``eval-drafter --dataset``: each named set decoded by the lossless loop or a serving engine.

    result = run_sets(settings, store, config, DatasetRequest(specs, num=128, thinking=None,
                      max_new_tokens=512, block_size=None, engine=EvalEngine.LOCAL))
    result["datasets"]["gsm8k"]["tau"], result["definition"]["tau"]

Prompts go through the target's chat template, thinking as ``thinking`` says (None: the run's
mode, per prompt id as generation renders it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.choices import EvalEngine
from common.config import Settings
from common.engine.sampling import Sampling
from common.errors import InputError
from workers.train.eval_sets import DatasetSpec, SetPrompt, fetch_set, read_set
from workers.train.eval_table import DEFINITION, local_entry, served_entry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetRequest:
    """What ``eval-drafter --dataset`` asks for."""

    specs: Sequence[DatasetSpec]
    num: int
    thinking: bool | None
    max_new_tokens: int
    block_size: int | None = None
    engine: EvalEngine = EvalEngine.LOCAL
    url: str | None = None
    baseline_url: str | None = None
    levels: Sequence[int] = (1,)


def file_rows(config: Any, path: str, num: int) -> list[Any]:
    """Up to ``num`` rows of any input enqueue reads, with the run's settings."""
    from common.runs.intake import Intake

    intake = Intake(replace(config, input=[path], limit=None))
    rows: list[Any] = []
    errors: list[str] = []
    for item in intake.rows():
        if item.row is not None:
            rows.append(item.row)
        elif len(errors) < 3:
            errors.append(f"{item.where}: {item.error}")
        if len(rows) >= num:
            break
    if not rows:
        raise InputError(f"no usable prompt in {path}" +
                         (f" ({'; '.join(errors)})" if errors else ""))
    return rows


def set_source(settings: Settings, config: Any, spec: DatasetSpec,
               num: int) -> list[SetPrompt] | list[Any]:
    """One set read (a standard set's prompts, or a prompt file's rows), before any model
    loads: a bad file costs nothing."""
    if spec.kind is None:
        assert spec.path is not None
        return file_rows(config, spec.path, num)
    return read_set(spec.kind, spec.path or fetch_set(spec.kind, Path(settings.target.cache_dir)),
                    num)


def set_prompts(config: Any, tokenizer: Any, source: list[Any], num: int,
                thinking: bool | None) -> list[Any]:
    """One set's prompts as the target sees them (:class:`EvalPrompt`)."""
    from workers.train.evaluation import EvalPrompt, encode_prompt, row_prompts

    sampling: Sampling | bool = config.sampling if thinking is None else thinking
    if source and not isinstance(source[0], SetPrompt):
        return row_prompts(source, tokenizer, sampling, num, config.chat_template_kwargs)
    prompts = []
    for item in source:
        on = sampling if isinstance(sampling, bool) else sampling.thinking_for(item.id)
        prompts.append(EvalPrompt(item.id, encode_prompt(
            tokenizer, [{"role": "user", "content": item.text}], on,
            config.chat_template_kwargs)))
    return prompts


def decode_set(target: Any, proposer: Any, prompts: Sequence[Any], layer_ids: Sequence[int],
               max_new_tokens: int, stops: set[int],
               progress: Callable[[], None]) -> dict[str, Any]:
    """The lossless loop over one set, each prompt checked against greedy decoding."""
    from common.faults import inject
    from workers.train.drafter.specdec import (
        AcceptanceStats,
        greedy_generate,
        speculative_generate,
    )
    from workers.train.evaluation import EvalReport, first_difference

    inject("eval")
    results = []
    report = EvalReport(AcceptanceStats.of([], proposer.block_size))
    for prompt in prompts:
        out = speculative_generate(target, proposer, prompt.ids, layer_ids, max_new_tokens,
                                   stops)
        results.append(out)
        plain = greedy_generate(target, prompt.ids, max_new_tokens, stops)
        report.checked += 1
        if plain.tokens != out.tokens:
            report.mismatches.append({"prompt": prompt.id,
                                      **first_difference(plain.tokens, out.tokens)})
            log.error("prompt %s: speculative decoding differs from greedy decoding: %s",
                      prompt.id, report.mismatches[-1])
        progress()
    report.stats = AcceptanceStats.of(results, proposer.block_size)
    return local_entry(results, report.to_json())


def run_sets(settings: Settings, config: Any, request: DatasetRequest,
             load: Callable[[], Any]) -> dict[str, Any]:
    """Every set of ``request``; ``load()`` gives ``(target, drafter, step, device)`` for the
    local loop (the serving engine needs the tokenizer only)."""
    context = {"run": config.run, "engine": request.engine.value,
               "max_new_tokens": request.max_new_tokens,
               "thinking": (config.sampling.thinking_mode if request.thinking is None
                            else "on" if request.thinking else "off")}
    sources = {spec.name: set_source(settings, config, spec, request.num)
               for spec in request.specs}
    if request.engine == EvalEngine.SGLANG:
        return {**context, **_served(settings, config, request, sources)}
    target, drafter, step, device = load()
    return {**context, "step": step, "device": str(device),
            **_local(config, request, sources, target, drafter)}


def _local(config: Any, request: DatasetRequest, sources: dict[str, list[Any]], target: Any,
           drafter: Any) -> dict[str, Any]:
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from workers.train.drafter.specdec import DFlashProposer
    from workers.train.evaluation import stop_ids

    sets = {name: set_prompts(config, target.tokenizer, source, request.num, request.thinking)
            for name, source in sources.items()}
    proposer = DFlashProposer(drafter, request.block_size)
    stops = stop_ids(target.model, target.tokenizer)
    datasets = {}
    with torch.inference_mode(), Progress(transient=True, console=Console(stderr=True)) as bar:
        for name, prompts in sets.items():
            task = bar.add_task(f"{name}: decoding {len(prompts)} prompts", total=len(prompts))
            datasets[name] = decode_set(target.model, proposer, prompts,
                                        drafter.config.target_layer_ids, request.max_new_tokens,
                                        stops, functools.partial(bar.advance, task))
            log.info("run %s: dataset %s decoded: tau %s", config.run, name,
                     datasets[name]["tau"])
    return {"block_size": proposer.block_size, "datasets": datasets, "definition": DEFINITION}


def _served(settings: Settings, config: Any, request: DatasetRequest,
            sources: dict[str, list[Any]]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from common.engine.models import resolve_model_path
    from workers.train.eval_serving import check_levels, measure_levels

    assert request.url is not None
    tokenizer = AutoTokenizer.from_pretrained(
        str(resolve_model_path(settings.replace(model=config.model))))
    sets = {name: set_prompts(config, tokenizer, source, request.num, request.thinking)
            for name, source in sources.items()}
    for line in check_levels({name: len(p) for name, p in sets.items()}, request.levels):
        log.warning("run %s: %s", config.run, line)
    datasets = {}
    for name, prompts in sets.items():
        levels = measure_levels(request.url, request.baseline_url, [p.ids for p in prompts],
                                request.max_new_tokens, request.levels)
        datasets[name] = served_entry(len(prompts), levels)
        log.info("run %s: dataset %s served at %s", config.run, name, request.url)
    return {"url": request.url, "baseline_url": request.baseline_url, "datasets": datasets,
            "definition": DEFINITION}

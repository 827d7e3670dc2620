"""The drafter's real acceptance length on prompts it never trained on (``eval-drafter``, and the
train worker every ``--eval-steps`` steps).

    prompts = heldout_prompts(storage, config, manifest, tokenizer, num=64)
    report = evaluate(target, DFlashProposer(drafter), prompts, drafter.config.target_layer_ids,
                      max_new_tokens=512, stops=stop_ids(target, tokenizer), check=True)
    report.to_json()["tau"], report.mismatches      # a mismatch is a bug in the loop

Prompts are rendered as the generate stage renders them (the chat template of the run's first
user turn, thinking as the run's sampling says). ``check`` also decodes each prompt greedily,
token by token, and compares: speculative decoding must reproduce it exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common import keys
from common.choices import RowKind
from common.engine.models import render_chat
from common.engine.sampling import Sampling
from common.faults import inject
from common.reads import limits_of, rows_or_none
from common.row_caps import row_caps
from common.runs.records import InputManifest, RunConfig
from common.runs.schemas import INPUT_ROW
from common.storage import Storage
from workers.train.drafter.specdec import (
    AcceptanceStats,
    Decoded,
    Proposer,
    greedy_generate,
    speculative_generate,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalPrompt:
    """A prompt as the target sees it: id and token ids."""

    id: str
    ids: list[int]


def stop_ids(target: PreTrainedModel, tokenizer: Any) -> set[int]:
    """Where generation ends: the generation config's EOS ids and the tokenizer's EOS."""
    eos = getattr(target.generation_config, "eos_token_id", None)
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return stops


def encode_prompt(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool,
                  template_kwargs: dict[str, Any] | None = None,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    ids: list[int] = tokenizer.encode(
        render_chat(tokenizer, messages, thinking, template_kwargs, tools),
        add_special_tokens=False)
    return ids


def row_prompts(rows: Iterable[Mapping[str, Any]], tokenizer: Any, sampling: Sampling | bool,
                num: int, template_kwargs: dict[str, Any] | None = None) -> list[EvalPrompt]:
    """The first user turn of up to ``num`` input rows (``{"id", "turns"}`` as enqueue stores),
    each in the thinking mode the run gives it, with its tools."""
    if isinstance(sampling, bool):
        sampling = Sampling(thinking=sampling)
    prompts: list[EvalPrompt] = []
    for row in rows:
        if len(prompts) >= num:
            break
        thinking = sampling.thinking_for(str(row["id"]))
        prompts.append(EvalPrompt(str(row["id"]), encode_prompt(
            tokenizer, row["turns"][0], thinking, template_kwargs, row.get("tools"))))
    return prompts


def heldout_prompts(storage: Storage, config: RunConfig, manifest: InputManifest,
                    tokenizer: Any, num: int) -> list[EvalPrompt]:
    """Up to ``num`` of the run's held-out prompts, in input order, from its input shards."""
    wanted: dict[int, set[str]] = {}
    for sample_id, shard in manifest.heldout[:num]:
        wanted.setdefault(int(shard), set()).add(str(sample_id))
    cap = row_caps(RowKind.INPUT, config, limits_of(storage))   # what a shard of it holds
    rows = (row for shard in sorted(wanted)
            for row in rows_or_none(storage, keys.input_shard(config.run, shard), INPUT_ROW,
                                    cap=cap) or []
            if row["id"] in wanted[shard])
    return row_prompts(rows, tokenizer, config.sampling, num,
                       config.chat_template_kwargs)


@dataclass
class EvalReport:
    """Acceptance statistics of one evaluation, and its check against plain greedy decoding."""

    stats: AcceptanceStats
    checked: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    greedy_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        timing = {"seconds": round(self.seconds, 3)}
        if self.checked:
            timing["greedy_seconds"] = round(self.greedy_seconds, 3)
        return {**self.stats.to_json(), "lossless": {"checked": self.checked,
                                                     "mismatches": self.mismatches}, **timing}


def first_difference(expected: Sequence[int], got: Sequence[int]) -> dict[str, Any]:
    at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
              min(len(expected), len(got)))
    return {"position": at, "greedy": expected[at] if at < len(expected) else None,
            "speculative": got[at] if at < len(got) else None}


def evaluate(target: PreTrainedModel, proposer: Proposer, prompts: Sequence[EvalPrompt],
             layer_ids: Sequence[int], max_new_tokens: int, stops: set[int], check: bool,
             progress: Callable[[int, int], None] | None = None) -> EvalReport:
    """Speculative decoding of every prompt; with ``check``, compared with greedy decoding."""
    inject("eval")
    results: list[Decoded] = []
    report = EvalReport(AcceptanceStats.of([], proposer.block_size))
    for done, prompt in enumerate(prompts, 1):
        started = time.perf_counter()
        out = speculative_generate(target, proposer, prompt.ids, layer_ids, max_new_tokens, stops)
        report.seconds += time.perf_counter() - started
        results.append(out)
        if check:
            started = time.perf_counter()
            plain = greedy_generate(target, prompt.ids, max_new_tokens, stops)
            report.greedy_seconds += time.perf_counter() - started
            report.checked += 1
            if plain.tokens != out.tokens:
                report.mismatches.append({"prompt": prompt.id,
                                          **first_difference(plain.tokens, out.tokens)})
                log.error("prompt %s: speculative decoding differs from greedy decoding: %s",
                          prompt.id, report.mismatches[-1])
        if progress is not None:
            progress(done, len(prompts))
    report.stats = AcceptanceStats.of(results, proposer.block_size)
    return report

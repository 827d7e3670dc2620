"""``enqueue ... --dry-run [--show N]``: what a run would be, before a week of GPUs is spent on it.

Reads and validates every input row exactly as ``enqueue`` does (same files, layouts, ids,
context check), writes nothing to storage and sends nothing to Redis, and prints the files with
the layout detected in each, the counts, the rejected rows, the text fields no prompt uses, and
the first N rows rendered as the model will see them (chat template, thinking flag, tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from common.config import Settings
from common.drafter.origin import DrafterSummary
from common.engine.models import render_chat, resolve_model_path
from common.engine.target_sampling import sampling_line
from common.runs.intake import Intake, RowCheck
from common.runs.records import RunConfig
from producer.enqueue import Tally

ANSWER_PLACEHOLDER = "[the model's answer to turn {}]"


@dataclass
class DryRunReport:
    """Everything ``--dry-run`` found; ``to_json`` for ``--json``, ``render`` for people."""

    run: str
    rows: int = 0
    rejected: int = 0
    shards: int = 0
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)
    unused: dict[str, dict[str, Any]] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    shown: list[dict[str, Any]] = field(default_factory=list)
    dry_run: bool = True
    sampling: dict[str, Any] = field(default_factory=dict)   # each value and its source
    drafter: DrafterSummary | None = None   # the frozen drafter shape's source (enqueue options)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def render(self) -> str:
        lines = [f"run {self.run} (dry run, nothing written): {self.rows} rows read, "
                 f"{self.rows - self.rejected} good, {self.rejected} rejected; would make "
                 f"{self.shards} shards"]
        lines += [f"  {name}: " + ", ".join(f"{layout} {n}" for layout, n in counts.items())
                  for name, counts in self.layouts.items()]
        lines += unused_lines(self.unused)
        if self.sampling:
            lines.append(sampling_line(self.sampling))
        if self.drafter:
            lines.append(drafter_line(self.drafter))
        if self.examples:
            lines.append("rejected rows:")
            lines += [f"  {where(e)}: {e['reason']}" for e in self.examples]
            if self.rejected > len(self.examples):
                lines.append(f"  ... and {self.rejected - len(self.examples)} more")
        for row in self.shown:
            later = "; later turns follow the model's own answers" if row["turns"] > 1 else ""
            mode = "on" if row.get("thinking", True) else "off"
            lines.append(f"--- {row['id']}: {row['prompt_tokens']} prompt tokens, "
                         f"{row['turns']} turn(s), thinking {mode}{later}")
            lines.append(row["prompt"].rstrip("\n"))
            for turn in row["turn_prompts"][1:]:
                lines.append(f"--- {row['id']} turn {turn['turn']}: {turn['prompt_tokens']} "
                             "prompt tokens, earlier answers shown as placeholders")
                lines.append(turn["prompt"].rstrip("\n"))
        return "\n".join(lines)


def drafter_line(drafter: DrafterSummary) -> str:
    """The drafter's frozen shape source and the run's target layers, in one line."""
    return (f"drafter shape: {drafter['source']}, target layers "
            f"{drafter['target_layer_ids']}")


def where(example: dict[str, Any]) -> str:
    """``line N`` or ``FILE line N`` for a rejected row (``(element K)`` in a JSON array)."""
    line = f"line {example['line']}" + (f" (element {example['element']})"
                                        if "element" in example else "")
    return f"{example['file']} {line}" if "file" in example else line


def unused_lines(unused: dict[str, dict[str, Any]]) -> list[str]:
    """The summary lines that say which text fields no prompt uses."""
    lines = []
    for name, entry in sorted(unused.items(), key=lambda kv: -kv[1]["rows"]):
        example = entry["example"]
        lines.append(f"  unused text field {name!r} in {entry['rows']} rows, e.g. "
                     f"{where(example)}: {example['value']!r} (not in any prompt; see "
                     "--prompt-template, --strict-fields)")
    return lines


def dry_run(settings: Settings, config: RunConfig, check: RowCheck | None,
            show: int) -> DryRunReport:
    """Read and judge every row as enqueue would; keep the first ``show`` good ones rendered."""
    report = DryRunReport(run=config.run)
    intake, tally = Intake(config, check), Tally()
    tokenizer = None
    good = 0
    for item in intake.started():
        row, _ = tally.judge(item)
        if row is None:
            continue
        good += 1
        if len(report.shown) < show:
            if tokenizer is None:
                from transformers import AutoTokenizer

                path = resolve_model_path(settings.replace(model=config.model))
                tokenizer = AutoTokenizer.from_pretrained(path)
            report.shown.append(rendered(tokenizer, row,
                                         config.sampling.thinking_for(row["id"]),
                                         config.chat_template_kwargs))
    report.rows, report.rejected, report.examples = tally.rows, tally.rejected, tally.examples
    report.shards = math.ceil(good / config.shard_size)
    report.layouts, report.unused = intake.layout_summary(), intake.unused
    return report


def rendered(tokenizer: Any, row: dict[str, Any], thinking: bool,
             template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every turn of a row as the target model receives it; the model's own earlier answers
    are not known before the run, so a placeholder stands in for each."""
    messages: list[dict[str, Any]] = []
    turns = []
    for number, group in enumerate(row["turns"], start=1):
        if messages:
            messages.append({"role": "assistant", "content": ANSWER_PLACEHOLDER.format(number - 1)})
        messages += group
        prompt = render_chat(tokenizer, messages, thinking, template_kwargs, row.get("tools"))
        turns.append({"turn": number, "messages": group, "prompt": prompt,
                      "prompt_tokens": len(tokenizer.encode(prompt, add_special_tokens=False))})
    first = turns[0]
    return {"id": row["id"], "turns": len(row["turns"]), "thinking": thinking,
            "prompt": first["prompt"],
            "prompt_tokens": first["prompt_tokens"], "turn_prompts": turns}

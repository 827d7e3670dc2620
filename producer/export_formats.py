"""The row of each ``export-dataset`` format, and the file writer for it.

==============  ================================================  =========================
format          one row                                           read by
==============  ================================================  =========================
``parquet``     a sample: ``id``, ``messages`` (with               Hugging Face ``datasets``,
                ``reasoning_content``), per-turn ``prompt_ids``,   pandas, anything Arrow
                ``output_ids``, ``finish_reason``, ``source``
``specforge``   ``{"id", "conversations": [{"role", "content",     SpecForge's training
                "reasoning_content"?}]}`` (JSONL)                  scripts
``messages``    ``{"id", "messages": [...]}``, OpenAI style,        OpenAI-style trainers,
                ``reasoning_content`` on assistant turns (JSONL)   vLLM speculators
``speculators`` an assistant turn: ``input_ids``, ``loss_mask``     vLLM speculators
                (prompt 0, generated tokens 1), ``metadata``
                (JSONL)
==============  ================================================  =========================

Reasoning is never inside ``content``: it is ``reasoning_content``. Tool use keeps its OpenAI
structure (assistant ``tool_calls``, ``tool`` messages with their ``tool_call_id``), and a row of
a tool-use sample carries its ``tools``; ``specforge`` and ``messages`` rows say the sample's
``thinking`` mode, so re-rendering a row with the target's template (``tools=``,
``enable_thinking=``, the run's template kwargs) gives the prompt of its last turn.
With ``--include-rejected`` rows also carry ``rejected`` and the gates' ``quality_reasons``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from common.choices import ExportFormat, Role
from common.runs.trainrows import has_token_ids, training_rows, turns_of

FORMATS = tuple(member.value for member in ExportFormat)
EXTENSIONS = {ExportFormat.PARQUET: "parquet", ExportFormat.SPECFORGE: "jsonl",
              ExportFormat.MESSAGES: "jsonl", ExportFormat.SPECULATORS: "jsonl"}
PARQUET_ROW_GROUP = 1000


def unexportable(sample: Mapping[str, Any], fmt: ExportFormat) -> str | None:
    """Why a (schema-valid) sample has no row in ``fmt``; None where it has: a part's schema
    lets a sample leave out what one format or another is made of."""
    if fmt in (ExportFormat.PARQUET, ExportFormat.SPECULATORS) and not has_token_ids(sample):
        return "no token ids"
    if fmt is ExportFormat.SPECULATORS:   # token ids only
        return None
    messages = sample.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m.get("role"), str)
                                                 for m in messages):
        return "no messages, or one with no role"
    if fmt is ExportFormat.PARQUET:
        if any(not isinstance(m.get(f), str | None) for m in messages
               for f in ("content", "reasoning_content")):
            return "a message's text that is no text"
        if not isinstance(sample.get("thinking"), bool | None):
            return "a thinking mode that is no bool"
        try:   # Arrow takes UTF-8 only; the JSON lines formats escape a lone surrogate
            json.dumps(sample, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return "text that UTF-8 cannot hold"
    return None


def messages_of(sample: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation with the regenerated assistant turns, reasoning kept where there is one."""
    out = []
    for message in sample["messages"]:
        item = {"role": message["role"], "content": message.get("content") or ""}
        if message["role"] == Role.ASSISTANT and message.get("reasoning_content"):
            item["reasoning_content"] = message["reasoning_content"]
        for key in ("tool_calls", "tool_call_id", "name"):
            if message.get(key):
                item[key] = message[key]
        out.append(item)
    return out


def _context(sample: Mapping[str, Any]) -> dict[str, Any]:
    """What a re-render needs beside the messages: the tools and the thinking mode."""
    out: dict[str, Any] = {}
    if sample.get("tools"):
        out["tools"] = sample["tools"]
    if sample.get("thinking") is not None:
        out["thinking"] = bool(sample["thinking"])
    return out


def _quality(sample: Mapping[str, Any], include_rejected: bool) -> dict[str, Any]:
    if not include_rejected:
        return {}
    quality = sample.get("quality", {})
    return {"rejected": not quality.get("passed", True),
            "quality_reasons": list(quality.get("reasons", []))}


def rows_of(sample: Mapping[str, Any], fmt: ExportFormat,
            include_rejected: bool) -> Iterator[dict[str, Any]]:
    """The export rows of one sample (one per assistant turn for ``speculators``)."""
    extra = _quality(sample, include_rejected)
    if fmt is ExportFormat.PARQUET:
        turns = turns_of(sample)
        yield {"id": sample["id"],
               "messages": [{"role": m["role"], "content": m["content"],
                             "reasoning_content": m.get("reasoning_content"),
                             "tool_calls": json.dumps(m["tool_calls"]) if m.get("tool_calls")
                             else None} for m in messages_of(sample)],
               "tools": json.dumps(sample["tools"]) if sample.get("tools") else None,
               "thinking": sample.get("thinking"),
               "prompt_ids": [list(t["prompt_ids"]) for t in turns],
               "output_ids": [list(t["output_ids"]) for t in turns],
               "finish_reason": [t.get("finish_reason", "stop") for t in turns],
               "source": json.dumps(sample.get("source", {}), ensure_ascii=False,
                                    sort_keys=True), **extra}
    elif fmt is ExportFormat.SPECFORGE:
        yield {"id": sample["id"], "conversations": messages_of(sample), **_context(sample),
               **extra}
    elif fmt is ExportFormat.MESSAGES:
        yield {"id": sample["id"], "messages": messages_of(sample), **_context(sample), **extra}
    else:
        turns = turns_of(sample)
        for row, turn in zip(training_rows(sample), turns, strict=True):
            yield {"id": f"{sample['id']}#{row.turn}", "sample_id": sample["id"],
                   "turn": row.turn, "input_ids": row.input_ids, "loss_mask": row.loss_mask,
                   "metadata": {"finish_reason": turn.get("finish_reason", "stop"),
                                "usage": {"prompt_tokens": len(turn["prompt_ids"]),
                                          "completion_tokens": len(turn["output_ids"])}},
                   **extra}


def parquet_schema(include_rejected: bool) -> Any:
    import pyarrow as pa

    # Tool calls and definitions as JSON text: their argument objects have no fixed schema.
    message = pa.struct([("role", pa.string()), ("content", pa.string()),
                         ("reasoning_content", pa.string()), ("tool_calls", pa.string())])
    fields = [("id", pa.string()), ("messages", pa.list_(message)), ("tools", pa.string()),
              ("thinking", pa.bool_()),
              ("prompt_ids", pa.list_(pa.list_(pa.int32()))),
              ("output_ids", pa.list_(pa.list_(pa.int32()))),
              ("finish_reason", pa.list_(pa.string())), ("source", pa.string())]
    if include_rejected:
        fields += [("rejected", pa.bool_()), ("quality_reasons", pa.list_(pa.string()))]
    return pa.schema(fields)


class FileWriter:
    """Writes one export file to a local temporary path, streaming (row groups or lines)."""

    def __init__(self, path: Path, fmt: ExportFormat, include_rejected: bool) -> None:
        self.path, self.fmt, self.rows = path, fmt, 0
        self._pending: list[dict[str, Any]] = []
        if fmt is ExportFormat.PARQUET:
            import pyarrow.parquet as pq

            self._schema = parquet_schema(include_rejected)
            self._parquet = pq.ParquetWriter(path, self._schema, compression="zstd")
        else:
            self._lines = open(path, "wb")

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        if self.fmt is not ExportFormat.PARQUET:
            text = json.dumps(row, ensure_ascii=False)
            try:
                line = text.encode()
            except UnicodeEncodeError:   # a lone surrogate: written escaped, as stored
                line = json.dumps(row).encode()
            self._lines.write(line + b"\n")
            return
        self._pending.append(row)
        if len(self._pending) >= PARQUET_ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._pending:
            self._parquet.write_table(pa.Table.from_pylist(self._pending, schema=self._schema))
            self._pending = []

    def close(self) -> None:
        if self.fmt is ExportFormat.PARQUET:
            self._flush()
            self._parquet.close()
        else:
            self._lines.close()

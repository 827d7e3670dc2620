"""Read a run's inputs into validated rows: every file its ``--input`` names, every row layout.

``enqueue`` (and ``enqueue --dry-run``) iterate :meth:`Intake.rows`: each item is a good row
(a conversation as JSON) or a rejected one with its place and reason. On the way the intake
counts the layout detected per file and the text fields no prompt uses, with an example each,
for the summary. Streaming: one row at a time, whatever the number or size of the files.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from common.errors import BadRow
from common.records import RunConfig
from common.storage import s3_client
from producer.layouts import normalize_row
from producer.readers import iter_records
from producer.sources import InputFile, expand_inputs

RowCheck = Callable[[dict[str, Any]], "str | None"]
EXAMPLE_CHARS = 120


@dataclass(frozen=True, slots=True)
class Item:
    """A good row (``row``) or a rejected one (``error``), with where it came from."""

    where: dict[str, Any]
    row: dict[str, Any] | None
    error: str | None


@dataclass
class Intake:
    """One pass over a run's input files, with what the summary reports about them."""

    config: RunConfig
    check: RowCheck | None = None
    files: list[InputFile] = field(default_factory=list)
    layouts: dict[str, Counter[str]] = field(default_factory=dict)
    unused: dict[str, dict[str, Any]] = field(default_factory=dict)

    def rows(self) -> Iterator[Item]:
        inputs = self.config.inputs
        factory = s3_client if any(i.startswith("s3://") for i in inputs) else None
        self.files = expand_inputs(inputs, s3_client_factory=factory)
        prefix_ids = len(self.files) > 1
        count = 0
        for source in self.files:
            self.layouts[source.name] = Counter()
            for record in iter_records(source.path, s3_client_factory=factory):
                if self.config.limit is not None and count >= self.config.limit:
                    return
                count += 1
                where = {"line": record.line, **({"file": source.name} if prefix_ids else {})}
                if record.error is not None:
                    yield Item(where, None, record.error)
                    continue
                yield from self._normalized(source, where, record.data, prefix_ids)

    def _normalized(self, source: InputFile, where: dict[str, Any], data: object,
                    prefix_ids: bool) -> Iterator[Item]:
        config = self.config
        try:
            result = normalize_row(data, config.format, config.prompt_field,
                                   config.prompt_template, config.strict_fields)
        except BadRow as bad:
            yield Item(where, None, str(bad))
            return
        self.layouts[source.name][result.layout] += 1
        for name in result.unused:
            self._count_unused(name, data, source, where)
        for conversation in result.conversations:
            if prefix_ids:
                conversation = dataclasses.replace(conversation,
                                                   id=f"{source.stem}/{conversation.id}")
            row = conversation.to_json()
            reason = self.check(row) if self.check is not None else None
            yield Item(where, None, reason) if reason else Item(where, row, None)

    def _count_unused(self, name: str, data: Any, source: InputFile,
                      where: dict[str, Any]) -> None:
        entry = self.unused.setdefault(name, {"rows": 0})
        entry["rows"] += 1
        if "example" not in entry:
            entry["example"] = {"file": source.name, "line": where["line"],
                                "value": str(data[name])[:EXAMPLE_CHARS]}

    def layout_summary(self) -> dict[str, dict[str, int]]:
        return {name: dict(counts) for name, counts in self.layouts.items()}

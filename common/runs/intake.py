"""Read a run's inputs into validated rows: every file its ``--input`` names, every row layout.

``enqueue`` (and ``enqueue --dry-run``) iterate :meth:`Intake.rows`: each item is a good row
(a conversation as JSON) or a rejected one with its place and reason. On the way the intake
counts the layout detected per file and the text fields no prompt uses, with an example each,
for the summary. Streaming: one row at a time, whatever the number or size of the files.

Across the files of one input, a conversation equal to one from an earlier file (same content
hash: the turns, system prompt included) is rejected naming that file and line; within a file,
duplicates are found by id (a row without an id has its content hash as id).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from common.errors import BadRow, InputError
from common.inputs.fields import example_of
from common.inputs.layouts import normalize_row
from common.inputs.readers import RawRecord, iter_records
from common.inputs.sources import InputFile, expand_inputs
from common.runs.records import RunConfig
from common.s3_storage import s3_client

log = logging.getLogger(__name__)

RowCheck = Callable[[dict[str, Any]], "str | None"]
_LINE_BITS = 40  # a first occurrence is kept as file index << 40 | line: one int per row


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
    _first: dict[int, int] = field(default_factory=dict)  # content digest -> first place
    _pending: Iterator[Item] | None = None

    def rows(self) -> Iterator[Item]:
        """Every item of every input file; InputError when the input holds no row at all."""
        inputs = self.config.inputs
        factory = s3_client if any(i.startswith("s3://") for i in inputs) else None
        self.files = expand_inputs(inputs, s3_client_factory=factory)
        prefix_ids = len(self.files) > 1
        count = 0
        for index, source in enumerate(self.files):
            self.layouts[source.name] = Counter()
            for record in iter_records(source.path, s3_client_factory=factory):
                if self.config.limit is not None and count >= self.config.limit:
                    return
                count += 1
                where = place(record, source.name if prefix_ids else None)
                if record.error is not None:
                    yield Item(where, None, record.error)
                    continue
                yield from self._normalized(index, where, record.data, prefix_ids)
        if count == 0:
            names = ", ".join(f.name for f in self.files[:3]) + (
                f" and {len(self.files) - 3} more" if len(self.files) > 3 else "")
            raise InputError(f"the input holds no rows at all ({names}): nothing to enqueue")

    def started(self) -> Iterator[Item]:
        """:meth:`rows` with the first item read already: an empty input fails here, before
        the caller writes anything."""
        if self._pending is None:
            items = self.rows()
            self._pending = itertools.chain([next(items)], items)
        return self._pending

    def _normalized(self, index: int, where: dict[str, Any], data: object,
                    prefix_ids: bool) -> Iterator[Item]:
        config, source = self.config, self.files[index]
        try:
            result = normalize_row(data, config.format, config.prompt_field,
                                   config.prompt_template, config.strict_fields)
        except BadRow as bad:
            yield Item(where, None, str(bad))
            return
        matched = ", ".join(f"{found} as {name}" for found, name in result.matched)
        label = f"{result.layout} ({matched})" if matched else result.layout.value
        if matched and label not in self.layouts[source.name]:
            log.warning("%s: fields read case-insensitively: %s", source.name, matched)
        self.layouts[source.name][label] += 1
        for name in result.unused:
            self._count_unused(name, data, source, where)
        for conversation in result.conversations:
            if prefix_ids:
                duplicate = self._earlier_file(conversation.turns, index, where["line"])
                if duplicate:
                    yield Item(where, None, duplicate)
                    continue
                conversation = dataclasses.replace(conversation,
                                                   id=f"{source.stem}/{conversation.id}")
            row = conversation.to_json()
            reason = self.check(row) if self.check is not None else None
            yield Item(where, None, reason) if reason else Item(where, row, None)

    def _earlier_file(self, turns: list[list[dict[str, Any]]], index: int, line: int) -> str | None:
        """Why a conversation is a duplicate of one in an earlier file, or None."""
        # Python's own 64-bit string hash: cached on each string, salted per process, which is
        # fine for a registry that lives as long as this one pass.
        digest = hash(tuple((m["role"], m["content"], len(group)) for group in turns
                            for m in group))
        first = self._first.setdefault(digest, index << _LINE_BITS | line)
        first_file = first >> _LINE_BITS
        if first_file == index:
            return None  # the first occurrence, or a repeat inside one file (judged by id)
        first_line = first & ((1 << _LINE_BITS) - 1)
        return (f"duplicate of {self.files[first_file].name} line {first_line} (same "
                "conversation in an earlier file of this input)")

    def _count_unused(self, name: str, data: Any, source: InputFile,
                      where: dict[str, Any]) -> None:
        entry = self.unused.setdefault(name, {"rows": 0})
        entry["rows"] += 1
        if "example" not in entry:
            value = data.get(name)
            if value is None:  # matched case-insensitively: the row holds another spelling
                value = next((v for k, v in data.items() if str(k).lower() == name.lower()), "")
            entry["example"] = {"file": source.name, "line": where["line"],
                                "value": example_of(value)}

    def layout_summary(self) -> dict[str, dict[str, int]]:
        return {name: dict(counts) for name, counts in self.layouts.items()}


def place(record: RawRecord, file: str | None) -> dict[str, Any]:
    """Where a record is: its line, its element number in a JSON array, its file."""
    return {"line": record.line, **({"element": record.element} if record.element else {}),
            **({"file": file} if file else {})}

"""``.json`` documents as rows: an array of objects (or an object wrapping one such list), with
the file line where each element starts, so a rejected row is found in an editor.

The document is walked element by element with :meth:`json.JSONDecoder.raw_decode` (the C
scanner, as fast as ``json.loads``), which also gives each element's offset; lines are counted
between consecutive offsets, so the cost stays linear in the file size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from common.errors import InputError

BOM = b"\xef\xbb\xbf"
# Keys that mark an object as one conversation rather than a wrapper around a list of rows.
ROW_KEYS = frozenset({"messages", "conversations", "turns"})
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()

Located = list[tuple[int, Any]]  # (offset of the element in the text, the element)


def _skip(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


def _expect(text: str, pos: int, chars: str) -> str:
    if pos >= len(text) or text[pos] not in chars:
        raise json.JSONDecodeError(f"Expecting one of {chars!r}", text, pos)
    return text[pos]


def _array(text: str, pos: int) -> tuple[Located, int]:
    """The elements of the array starting at ``text[pos] == '['`` with their offsets."""
    items: Located = []
    pos = _skip(text, pos + 1)
    if text.startswith("]", pos):
        return items, pos + 1
    while True:
        value, end = _DECODER.raw_decode(text, pos)
        items.append((pos, value))
        pos = _skip(text, end)
        if _expect(text, pos, ",]") == "]":
            return items, pos + 1
        pos = _skip(text, pos + 1)


def _object(text: str, pos: int) -> tuple[dict[str, Any], dict[str, Located], int]:
    """The object at ``text[pos] == '{'``, and the located elements of its list values."""
    data: dict[str, Any] = {}
    lists: dict[str, Located] = {}
    pos = _skip(text, pos + 1)
    if text.startswith("}", pos):
        return data, lists, pos + 1
    while True:
        _expect(text, pos, '"')
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _skip(text, pos)
        _expect(text, pos, ":")
        pos = _skip(text, pos + 1)
        if text.startswith("[", pos):
            located, pos = _array(text, pos)
            lists[key] = located
            data[key] = [value for _, value in located]
        else:
            data[key], pos = _DECODER.raw_decode(text, pos)
        pos = _skip(text, pos)
        if _expect(text, pos, ",}") == "}":
            return data, lists, pos + 1
        pos = _skip(text, pos + 1)


def _document(text: str, where: str) -> Located:
    """The located rows of a whole document (see :func:`rows_from_json_document`)."""
    start = _skip(text, 0)
    if text.startswith("[", start):
        rows, end = _array(text, start)
    elif text.startswith("{", start):
        data, lists, end = _object(text, start)
        if ROW_KEYS & data.keys():
            rows = [(start, data)]  # a single conversation saved as one object
        elif len(lists) == 1 and sum(isinstance(v, list) for v in data.values()) == 1:
            rows = next(iter(lists.values()))
        else:
            rows = None
    else:
        value, end = _DECODER.raw_decode(text, start)
        rows = None
        data = value
    if _skip(text, end) != len(text):
        raise json.JSONDecodeError("Extra data", text, _skip(text, end))
    if rows is None:
        kind = "object" if text.startswith("{", start) else type(data).__name__
        raise InputError(
            f"{where}: expected a top-level JSON array of objects (or an object with one "
            f'list-valued key such as {{"data": [...]}}), got {kind}')
    return rows


def located_rows(blob: bytes, where: str) -> Iterator[tuple[int, int, Any]]:
    """``(file line, element number, row)`` for every row of a ``.json`` file's bytes."""
    blob = blob.removeprefix(BOM)
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: invalid UTF-8 at byte {exc.start}") from None
    del blob
    try:
        rows = _document(text, where)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{where}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputError(f"{where}: invalid JSON: nested too deeply") from None
    line, last = 1, 0
    for element, (offset, row) in enumerate(rows, start=1):
        line += text.count("\n", last, offset)
        last = offset
        yield line, element, row

"""Which fields of a row hold text, and how their names are matched, for every row layout.

A field holds text when a non-blank string is anywhere in it: the value itself, or inside its
lists and objects (``"followups": ["second question"]``, ``"meta": {"hint": "..."}``). Text that
no prompt uses is reported (or, with ``--strict-fields``, rejected) whatever its type. Known
field names are matched case-insensitively (WizardLM's ``Instruction`` is ``instruction``) when
the exact name is absent, and each such match is reported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from common.inputs.rows import ANSWER_FIELDS, ID_FIELDS

# Short labels that describe a row rather than ask anything; never reported as unused text.
METADATA_FIELDS = frozenset({"category", "source", "dataset", "subset", "split", "name", "task",
                             "task_type", "type", "lang", "language", "license", "url", "model",
                             "domain", "difficulty", "tags", "skill"})
EXAMPLE_CHARS = 120


def texts_in(value: object) -> Iterator[str]:
    """Every non-blank string in a value, its lists and objects (keys excluded)."""
    if isinstance(value, str):
        if value.strip():
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from texts_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from texts_in(item)


def has_text(value: object) -> bool:
    if isinstance(value, str):  # the common case, without a generator
        return bool(value.strip())
    return value is not None and next(texts_in(value), None) is not None


def unused_fields(data: dict[str, Any], used: set[str]) -> tuple[str, ...]:
    """Fields with text, of any type, that no prompt of this row reads."""
    ignored = ANSWER_FIELDS | METADATA_FIELDS | set(ID_FIELDS)
    return tuple(sorted(k for k, v in data.items() if isinstance(k, str) and k not in used
                        and k.lower() not in ignored and has_text(v)))


def example_of(value: object) -> str:
    """A short printable form of a field's value for the summary."""
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, default=str)
    return value[:EXAMPLE_CHARS]


def match_case(data: dict[str, Any], names: Iterable[str],
               ) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """``data`` with known field names found case-insensitively renamed to their known form,
    and the ``(found, known)`` pairs renamed; the row is returned as is when none needs it."""
    odd = [k for k in data if isinstance(k, str) and not k.islower() and data[k] is not None]
    if not odd:
        return data, ()
    by_lower: dict[str, list[str]] = {}
    for key in odd:
        by_lower.setdefault(key.lower(), []).append(key)
    renamed = []
    for name in names:
        found = by_lower.get(name, [])
        if data.get(name) is None and len(found) == 1:
            renamed.append((found[0], name))
    if not renamed:
        return data, ()
    mapping = dict(renamed)
    fixed = {mapping.get(k, k): v for k, v in data.items() if not (k in mapping.values()
                                                                  and k not in mapping)}
    return fixed, tuple(renamed)

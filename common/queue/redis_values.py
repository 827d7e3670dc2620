"""Numbers read from Redis text, typed and bounded: a value any role wrote never stops a reader.

    checked = count_of(key, stats.get("checked"))        # 0 where absent or foreign (noted)
    tau = number_of(key, metrics.get("tau"))             # None where absent or foreign

A Redis value is text any role with Redis access may write; ``int()`` on it raises on ``"x"``,
takes ``"1_0"`` and other scripts' digits, and ``float()`` takes ``"nan"``. These take only what
an honest writer writes (ASCII digits of a bounded length, a finite float); anything else is a
:class:`common.errors.ForeignObject`, noted once per key (``status --json``'s
``foreign_objects``: area ``redis``), and read as absent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from common import keys
from common.errors import ForeignObject, MalformedName
from common.reads import note

_COUNT = re.compile(r"\d{1,18}", re.ASCII)
_NUMBER = re.compile(r"-?\d{1,18}(?:\.\d{1,18})?(?:[eE][-+]?\d{1,3})?", re.ASCII)


def _text(value: object) -> str | None:
    if value is None or value == "" or value == b"":
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def count_of(key: str, value: object, default: int = 0, low: int = 0) -> int:
    """An integer counter of at least ``low`` (0); ``default`` where absent or foreign
    (noted)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= low:
        return value
    text = _text(value)
    if text is None:
        return default
    if _COUNT.fullmatch(text) and int(text) >= low:
        return int(text)
    note(ForeignObject(key, f"not a count of at least {low}: {text[:40]!r}"))
    return default


def share_of(key: str, value: object, default: float) -> float:
    """A rate within [0, 1]; ``default`` where absent or foreign (noted)."""
    found = number_of(key, value)
    if found is None:
        return default
    if 0.0 <= found <= 1.0:
        return found
    note(ForeignObject(key, f"not a rate within [0, 1]: {found!r}"))
    return default


def number_of(key: str, value: object) -> float | None:
    """A finite number; None where absent or foreign (noted)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value):
        return float(value)
    text = _text(value)
    if text is None:
        return None
    if _NUMBER.fullmatch(text) and math.isfinite(found := float(text)):
        return found
    note(ForeignObject(key, f"not a finite number: {text[:40]!r}"))
    return None


def field_key(key: str, field: str) -> str:
    """How a hash field's value is named where it is noted (the hash's key, then the field)."""
    return f"{key}[{field[:80]}]"


def shard_counts(key: str, found: Mapping[object, object]) -> dict[int, int]:
    """A Redis hash of counts by shard name (samples in progress): a field that names no
    shard, or a value that is no count, is noted and left out."""
    counts = {}
    for name, value in found.items():
        try:
            shard = keys.parse_shard_name(str(name))
        except MalformedName:
            note(ForeignObject(field_key(key, str(name)), "not a shard name"))
            continue
        if (count := count_of(field_key(key, str(name)), value, -1)) >= 0:
            counts[shard] = count
    return counts

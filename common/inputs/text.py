"""Text checks every row layout shares: encodable strings, type names in reasons, JSON-safe
copies of a row's metadata."""

from __future__ import annotations

import math
import re
from typing import Any

from common.errors import BadRow

# Lone surrogates survive json.loads ("\ud800") but cannot be encoded as UTF-8 later.
_SURROGATE = re.compile("[\ud800-\udfff]")


def type_name(value: object) -> str:
    """Name a value's type the way reasons print it (``null`` for None)."""
    return "null" if value is None else type(value).__name__


def check_text(value: object, where: str) -> str:
    """Return ``value`` if it is an encodable string, else raise BadRow naming ``where``."""
    if not isinstance(value, str):
        raise BadRow(f"{where} must be a string, got {type_name(value)}")
    if _SURROGATE.search(value):
        raise BadRow(f"{where} contains an unpaired UTF-16 surrogate")
    return value


def jsonable(value: Any) -> Any:
    """Return a strict-JSON copy of ``value``, turning anything else into its ``str``."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        # Replace lone surrogates so the shard writer can always encode the source as UTF-8.
        return (
            value.encode("utf-8", "replace").decode("utf-8") if _SURROGATE.search(value) else value
        )
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)

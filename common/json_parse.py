"""The one JSON parse for every value a role may write (storage objects, Redis values).

    value = parse(key, data)   # bytes or str; any failure is ForeignObject(key, why)

orjson reads what it can; what it refuses only for a lone surrogate (``"\\ud800"``, as the
standard encoder escapes user text that UTF-8 cannot hold) is read by the standard parser with
``NaN``/``Infinity`` and non-finite numbers refused. Both see a nesting depth checked first, on
the bytes themselves (strings skipped), so neither the stdlib's recursion nor a reader that
walks the value later (a schema, ``json.dumps``) meets a body nested past :data:`MAX_DEPTH`.
No exception a body can choose leaves :func:`parse` but :class:`ForeignObject`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any, NoReturn

import orjson

from common.errors import ForeignObject

MAX_DEPTH = 100   # nesting levels of arrays and objects; an honest record nests under 10
_KEPT = b'"[]{}'
_OTHERS = bytes(b for b in range(256) if b not in _KEPT)
_SQUARE = bytes.maketrans(b"{}", b"[]")
_STRING = re.compile(rb'"[^"]*"')   # a string, once only quotes and brackets are left


def too_deep(data: bytes) -> bool:
    """Whether JSON text nests arrays and objects past :data:`MAX_DEPTH` (or leaves brackets
    unbalanced, which no JSON does), counting brackets outside strings only."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return False   # the common case: too few brackets to nest that deep at all
    if b"\\" in data:   # escapes: an escaped backslash, then an escaped quote, go first
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Only quotes and brackets left; two adjacent quotes enclose no bracket, so dropping them
    # changes no bracket's side; what remains in quotes is a string's brackets.
    brackets = _STRING.sub(b"", data.translate(_SQUARE, _OTHERS).replace(b'""', b""))
    for _ in range(MAX_DEPTH):   # each pass removes the innermost level
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def _number(text: str) -> int | float:
    """An integer as orjson reads it: past 64 bits a float, refused where that is infinite (so
    no reader's ``float()`` of a 400-digit integer overflows)."""
    value = int(text)
    return value if -2**63 <= value < 2**64 else _finite(text)


def parse(key: str, data: bytes | str) -> Any:
    """The JSON value of ``data`` (``key``: where it was read, for the error), or
    :class:`ForeignObject` for anything else: not JSON, too deep, NaN or Infinity."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    try:
        value = orjson.loads(raw)   # refuses NaN, Infinity, overflowing numbers and > 1024 deep
    except orjson.JSONDecodeError as exc:
        if "surrogate" not in str(exc):   # anything else is no JSON for the slower parser too
            raise ForeignObject(key, f"not JSON ({exc})") from None
    else:
        if too_deep(raw):
            raise ForeignObject(key, f"nested deeper than {MAX_DEPTH} levels")
        return value
    if too_deep(raw):   # checked before the recursive parser ever descends
        raise ForeignObject(key, f"nested deeper than {MAX_DEPTH} levels, or not JSON")
    try:   # lone surrogates, as the standard encoder escapes them
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite,
                          parse_int=_number)
    except (ValueError, RecursionError) as exc:   # UnicodeDecodeError is a ValueError
        raise ForeignObject(key, f"not JSON ({exc})") from None


def finite_list(values: Iterable[float], digits: int = 4) -> str:
    """JSON text of per-slot or per-position figures, rounded, null where one is not finite
    (NaN: not measured): what :func:`parse` reads back, NaN being refused."""
    return json.dumps([round(v, digits) if math.isfinite(v) else None for v in values])

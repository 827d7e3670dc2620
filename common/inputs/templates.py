"""``--prompt-template``: a prompt built from named fields of the row, and nothing else.

A placeholder is ``{field}`` or ``{field:format-spec}``; attribute access (``{a.__class__}``),
indexing (``{a[0]}``), conversions (``{a!r}``) and nested fields are refused when the run is
configured, so a template can only ever put a field's own text into the prompt.
"""

from __future__ import annotations

import string
from typing import Any

from common.errors import BadRow, ConfigError
from common.inputs.text import type_name


def template_fields(template: str) -> set[str]:
    """The row fields a ``--prompt-template`` reads; ConfigError for anything but ``{field}``
    or ``{field:spec}`` (attribute access, indexing and conversions could read other text)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"bad --prompt-template {template!r}: {exc}") from None
    names = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        shown = "{" + name + (f"!{conversion}" if conversion else "") + (
            f":{spec}" if spec else "") + "}"
        if (not name or name.isdigit() or "." in name or "[" in name or conversion
                or "{" in (spec or "")):
            raise ConfigError(
                f"--prompt-template placeholder {shown} is not allowed: name a field only, as "
                "{field} or {field:format-spec} (no attribute access, indexing, conversion or "
                "nested field)")
        names.add(name)
    return names


def from_template(data: dict[str, Any], template: str) -> str:
    """The template filled from the row, or BadRow for a missing or non-text field."""
    missing = [name for name in sorted(template_fields(template)) if data.get(name) is None]
    if missing:
        raise BadRow(f"--prompt-template needs field(s) {', '.join(missing)} "
                     f"(found keys: {', '.join(map(str, data))})")
    for name in sorted(template_fields(template)):
        if not isinstance(data[name], str | int | float):
            raise BadRow(f"--prompt-template field {name!r} is a {type_name(data[name])}, "
                         "not text")
    try:
        text = template.format_map({k: v for k, v in data.items() if isinstance(k, str)})
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise BadRow(f"--prompt-template does not fit this row: {exc!r}") from None
    return text

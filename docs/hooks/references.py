"""MkDocs hook: the settings reference, generated at build time from the declarations.

A page that holds ``<!-- settings-reference -->`` gets one table per settings section (the flat
name, its ``DFLASH_*`` variable, its default, the option and commands its declaration names, and
its help, else the comments beside it), and one per section of per-command options
(``common/cli/options.py`` and the sections declared beside their commands). The
command reference is mkdocs-click's, on the group of ``docs/hooks/cli_group.py``.
"""

from __future__ import annotations

import inspect
import io
import re
import sys
import tokenize
from dataclasses import MISSING, Field
from pathlib import Path
from typing import Any

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]
MARKER = "<!-- settings-reference -->"
RUN_JSON_MARKER = "<!-- run-json-schema -->"


def on_config(config: Any) -> Any:
    """Build from this checkout's code; mkdocs-click imports ``cli_group`` from here."""
    for path in (str(HOOKS), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, settings_markdown())
    if RUN_JSON_MARKER in markdown:
        markdown = markdown.replace(RUN_JSON_MARKER, run_json_markdown())
    return markdown


def _type_text(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " or ".join(_type_text(p) for p in prop["anyOf"])
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    kind = prop.get("type", "any")
    return "/".join(kind) if isinstance(kind, list) else kind


def run_json_markdown() -> str:
    """run.json's fields as a table, and its whole JSON Schema, generated from the code."""
    import json

    from common.runs.json_schema import run_json_schema

    schema = run_json_schema()
    rows = ["| field | type | what fills it |", "|---|---|---|"]
    for name, prop in schema["properties"].items():
        what = prop.get("description", "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}` | {_type_text(prop)} | {what} |")
    body = json.dumps(schema, indent=2)
    return "\n".join([*rows, "", '??? note "run.json\'s JSON Schema"', "", "    ```json",
                      *("    " + line for line in body.splitlines()), "    ```", ""])


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comments: the comment lines right above it and the one at its end."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        name = line.strip().split(":", 1)[0]
        if not name.isidentifier() or ":" not in line or line.strip().startswith("#"):
            continue
        above, k = [], number - 1
        while k >= 1 and lines[k - 1].strip().startswith("#"):
            above.insert(0, comments.get(k, ""))
            k -= 1
        words = [*above, comments.get(number, "")] if number in comments else above
        found[name] = " ".join(w for w in words if w)
    return found


def shown_default(value: Any, secret: bool = False) -> str:
    if value is MISSING or value is None or value == "" or (secret and value):
        return "(unset)"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return "(unset)" if not value else ", ".join(map(str, value))
    text = str(value)
    home = str(Path.home())
    if text.startswith(home):
        text = "~" + text[len(home):]
    return f"`{text}`"


def option_cell(flat: str, found: Any) -> str:
    """The flag a declaration makes and the commands that take it (``*``: every command that
    touches a run)."""
    if found is None or not found.commands and not found.at:
        return "-"
    flags = [d for d in found.decls if d.startswith("-")] or [f"--{flat.replace('_', '-')}"]
    commands = list(dict.fromkeys((*found.commands, *found.at)))
    where = ", ".join("every command" if c == "*" else c for c in commands)
    if len(commands) > 4:
        where = f"{len(commands)} commands"
    return f"`{max(flags, key=len).split('/')[0]}` ({where})"


def table(section: type, env_name: Any, section_fields: Any) -> str:
    from common.declared import declared

    comments = field_comments(section)
    rows = ["| setting | variable | default | CLI option | notes |", "|---|---|---|---|---|"]
    for flat, f in section_fields(section):
        f: Field[Any]
        found = declared(f)
        variable = f"`{env_name(flat)}`" if found is None or found.env else "-"
        notes = (found.help if found is not None else "") or comments.get(f.name, "")
        notes = notes.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{flat}` | {variable} | "
                    f"{shown_default(f.default, f.metadata.get('secret', False))} | "
                    f"{option_cell(flat, found)} | {notes} |")
    return "\n".join(rows)


def markdown_doc(obj: Any) -> str:
    """A docstring as Markdown: reST's double backquotes and roles as code spans."""
    text = inspect.getdoc(obj) or ""
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")


def settings_markdown() -> str:
    """Every setting and every per-command option, by section, as the code declares them."""
    from cli_group import cli  # noqa: F401 - loads every command, and its own options

    from common.cli import command_sections
    from common.cli import options as command_options
    from common.config import SECTIONS, env_name, section_fields

    parts = ["## Settings (`common/config_sections.py`)", ""]
    for name, section in SECTIONS.items():
        parts += [f"### `{name}`", "", markdown_doc(section), "",
                  table(section, env_name, section_fields), ""]
    parts += ["## Per-command options (`common/cli/options.py`, and beside each command)", "",
              markdown_doc(command_options), ""]
    for section in (*command_options.SECTIONS, *command_sections()):
        parts += [f"### {section.__name__}", "", markdown_doc(section), "",
                  table(section, env_name, section_fields), ""]
    return "\n".join(parts)

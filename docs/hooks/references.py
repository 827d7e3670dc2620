"""MkDocs hook: the settings reference, generated at build time from ``common/config.py``.

A page that holds ``<!-- settings-reference -->`` gets one table per settings section (the flat
name, its ``DFLASH_*`` variable, its default, the CLI options that set it, and the comments the
declaration carries), and one per section of per-command options (``common/cli/options.py``). The
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

import click

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]
MARKER = "<!-- settings-reference -->"
RUN_JSON_MARKER = "<!-- run-json-schema -->"
HELP = "help"   # the key under which cli_options_by_envvar keeps an option's help text


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


def cli_options_by_envvar() -> dict[str, dict[str, list[str]]]:
    """Variable -> option -> the commands that take it (and its first help text, under
    ``HELP``), from the whole click tree."""
    from cli_group import cli

    found: dict[str, dict[str, list[str]]] = {}

    def walk(command: click.Command, path: str) -> None:
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.envvar, str):
                option = max(param.opts, key=len)
                options = found.setdefault(param.envvar, {})
                options.setdefault(option, []).append(path)
                if param.help and HELP not in options:
                    options[HELP] = [param.help]
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())

    walk(cli, "")
    return found


def options_cell(options: dict[str, list[str]]) -> str:
    if not set(options) - {HELP}:
        return "-"
    cells = []
    for option, commands in sorted(options.items()):
        if option == HELP:
            continue
        where = ", ".join(commands) if len(commands) <= 4 else f"{len(commands)} commands"
        cells.append(f"`{option}` ({where})")
    return "<br>".join(cells)


def table(section: type, env_name: Any, section_fields: Any, by_envvar: dict[str, Any]) -> str:
    comments = field_comments(section)
    rows = ["| setting | variable | default | CLI option | notes |", "|---|---|---|---|---|"]
    for flat, f in section_fields(section):
        f: Field[Any]
        variable = env_name(flat)
        options = by_envvar.get(variable, {})
        notes = " ".join(options.get(HELP, [])) or comments.get(f.name, "")
        notes = notes.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{flat}` | `{variable}` | "
                    f"{shown_default(f.default, f.metadata.get('secret', False))} | "
                    f"{options_cell(options)} | {notes} |")
    return "\n".join(rows)


def markdown_doc(obj: Any) -> str:
    """A docstring as Markdown: reST's double backquotes and roles as code spans."""
    text = inspect.getdoc(obj) or ""
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")


def settings_markdown() -> str:
    """Every setting and every per-command option, by section, as the code declares them."""
    from common.cli import options as command_options
    from common.config import SECTIONS, env_name, section_fields

    by_envvar = cli_options_by_envvar()
    parts = ["## Settings (`common/config.py`)", ""]
    for name, section in SECTIONS.items():
        parts += [f"### `{name}`", "", markdown_doc(section), "",
                  table(section, env_name, section_fields, by_envvar), ""]
    parts += ["## Per-command options (`common/cli/options.py`)", "",
              markdown_doc(command_options), ""]
    for section in command_options.SECTIONS:
        parts += [f"### {section.__name__}", "", markdown_doc(section), "",
                  table(section, env_name, section_fields, by_envvar), ""]
    return "\n".join(parts)

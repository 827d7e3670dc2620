"""Exit codes are defined once, in ``common.exit_codes``, with the numbers the command reference
(docs/reference/cli.md) documents."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import click
from click.testing import CliRunner

from common import exit_codes
from tests.conftest import ROOT

_SKIP = {".venv", ".git", "node_modules", "build", "dist"}


def _assigned_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            elements = target.elts if isinstance(target, ast.Tuple | ast.List) else [target]
            names |= {e.id for e in elements if isinstance(e, ast.Name)}
            names |= {e.attr for e in elements if isinstance(e, ast.Attribute)}
    return names


def _python_files(root: Path) -> list[Path]:
    """The tree's .py files, never descending into a venv (.venv, .venv-sglang) or _SKIP."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP and not d.startswith(".venv")]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return found


def test_no_other_module_defines_an_exit_code() -> None:
    definer = ROOT / "common" / "exit_codes.py"
    offenders = []
    for path in sorted(_python_files(ROOT)):
        if path == definer:
            continue
        names = _assigned_names(ast.parse(path.read_text(), str(path)))
        offenders += [f"{path.relative_to(ROOT)}: {n}" for n in sorted(names)
                      if n.startswith("EXIT_")]
    assert not offenders, "exit codes belong in common/exit_codes.py: " + ", ".join(offenders)


def test_the_codes_are_the_documented_ones() -> None:
    assert (exit_codes.EXIT_OK, exit_codes.EXIT_FAILURE, exit_codes.EXIT_USAGE,
            exit_codes.EXIT_REJECTED, exit_codes.EXIT_MISMATCH) == (0, 1, 2, 3, 4)
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    documented = re.search(r"\*\*Exit codes:\*\*(.*?)\n\n", reference, re.S)
    assert documented is not None
    assert re.findall(r"(\d) [a-z`]", documented.group(1)) == ["0", "1", "2", "3", "4"]


def test_usage_is_clicks_own_code() -> None:
    result = CliRunner().invoke(click.Command("x", callback=lambda: None), ["--nope"])
    assert result.exit_code == exit_codes.EXIT_USAGE

"""Count the explicit ``Any`` in common/, workers/ and producer/ and fail above the stored ceiling.

The measure: every place our source names ``typing.Any`` (``Any`` or ``typing.Any`` as an
expression, in annotations, casts and aliases, and inside string annotations), read from the AST;
the import itself, comments and docstrings do not count. It counts the holes we chose to write,
not mypy's inferred ``Any`` expressions (``--any-exprs-report``): that report takes over a minute
on two busy cores and mostly counts untyped libraries' values (celery, boto3), which are
boundaries by definition. The ceiling (scripts/any_ceiling.txt) can only go down: ``--lower``
writes a smaller count into it, never a larger one.

Usage: ``python scripts/any_count.py [--by-file] [--lower] [--ceiling PATH] [ROOT]``; exit 0 at
or below the ceiling, 1 above it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("common", "workers", "producer")
HERE = Path(__file__).resolve().parent
CEILING = HERE / "any_ceiling.txt"


def _names_any(node: ast.AST) -> bool:
    """Say whether the node is the name ``Any`` or the attribute ``typing.Any``."""
    if isinstance(node, ast.Name):
        return node.id == "Any"
    return (isinstance(node, ast.Attribute) and node.attr == "Any"
            and isinstance(node.value, ast.Name) and node.value.id in ("typing", "t"))


def _annotations(tree: ast.AST) -> Iterator[ast.expr]:
    """Yield every annotation expression (a string one is parsed by the caller)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            yield node.annotation
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def count_source(source: str) -> int:
    """Count the ``Any`` one module's source names (string annotations included)."""
    tree = ast.parse(source)
    total = sum(1 for node in ast.walk(tree) if _names_any(node))
    for annotation in _annotations(tree):
        for node in ast.walk(annotation):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    inner = ast.parse(node.value, mode="eval")
                except SyntaxError:
                    continue
                total += sum(1 for sub in ast.walk(inner) if _names_any(sub))
    return total


def count_tree(root: Path) -> dict[str, int]:
    """Count per file (relative path -> count, files without any left out) under the packages."""
    counts: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            found = count_source(path.read_text(encoding="utf-8"))
            if found:
                counts[path.relative_to(root).as_posix()] = found
    return counts


def main(argv: list[str] | None = None) -> int:
    """Print the count beside the ceiling; exit 1 above it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=HERE.parent)
    parser.add_argument("--ceiling", type=Path, default=CEILING)
    parser.add_argument("--by-file", action="store_true", help="list the files, most first")
    parser.add_argument("--lower", action="store_true",
                        help="write the count as the new ceiling when it is lower")
    args = parser.parse_args(argv)
    counts = count_tree(args.root)
    total = sum(counts.values())
    ceiling = int(args.ceiling.read_text(encoding="utf-8").split()[0])
    if args.by_file:
        for name, found in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            print(f"{found:5d}  {name}")
    if args.lower and total < ceiling:
        args.ceiling.write_text(f"{total}\n", encoding="utf-8")
        print(f"any_count: ceiling lowered from {ceiling} to {total}")
        ceiling = total
    print(f"any_count: {total} explicit Any in {', '.join(PACKAGES)} (ceiling {ceiling})")
    if total > ceiling:
        print(f"any_count: {total - ceiling} above the ceiling: type what you added "
              "(Any only at real boundaries)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The explicit ``Any`` in common/, workers/ and producer/ can only go down: scripts/any_count.py
counts it (``scripts/test.sh`` prints it) and fails above scripts/any_ceiling.txt."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "any_count.py"


def _counter() -> ModuleType:
    spec = importlib.util.spec_from_file_location("any_count", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_tree_is_at_or_below_its_ceiling() -> None:
    done = _run()
    assert done.returncode == 0, done.stdout + done.stderr
    counted = sum(_counter().count_tree(ROOT).values())
    ceiling = int((ROOT / "scripts" / "any_ceiling.txt").read_text().split()[0])
    assert f"any_count: {counted} explicit Any" in done.stdout
    assert counted <= ceiling


def test_what_counts_as_an_any() -> None:
    source = '''
"""Any in a docstring is no type."""
import typing
from typing import Any, cast   # the import is no use of it
x: Any = 1                     # 1
def f(a: dict[str, Any]) -> "list[Any]":   # 2, 3 (a string annotation)
    return cast(Any, [a])      # 4
z: typing.Any                  # 5
Anything = "Any"               # a name and a string: neither
'''
    assert _counter().count_source(source) == 5


def _tree(root: Path, uses: int, ceiling: int) -> Path:
    for package in ("common", "workers", "producer"):
        (root / package).mkdir(parents=True)
    (root / "common" / "a.py").write_text(
        "from typing import Any\n" + "".join(f"v{i}: Any = {i}\n" for i in range(uses)))
    (root / "ceiling.txt").write_text(f"{ceiling}\n")
    return root / "ceiling.txt"


def test_above_the_ceiling_fails_and_it_is_only_ever_lowered(tmp_path: Path) -> None:
    over = _tree(tmp_path / "over", uses=3, ceiling=2)
    done = _run("--ceiling", over, tmp_path / "over")
    assert done.returncode == 1 and "1 above the ceiling" in done.stderr
    assert _run("--ceiling", over, "--lower", tmp_path / "over").returncode == 1
    assert over.read_text() == "2\n"   # --lower never raises it
    under = _tree(tmp_path / "under", uses=3, ceiling=7)
    done = _run("--ceiling", under, "--lower", "--by-file", tmp_path / "under")
    assert done.returncode == 0 and "ceiling lowered from 7 to 3" in done.stdout
    assert "    3  common/a.py" in done.stdout and under.read_text() == "3\n"

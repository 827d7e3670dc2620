"""The import graph keeps its layers: every top-level folder holding Python has a place in one
order and imports only folders below it (lazy imports too), no cycles, and what a lower layer
runs of a higher one (the stages' commands, the embedded models' builder) reaches it through
package entry points only."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from common.entry_points import COMMANDS, MODEL_BUILDERS, TINY_BUILDER, WORKER_COMMANDS

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (("common",), ("embedded",), ("workers", "producer"),
          ("benchmarks", "scripts", "docs", "docker"), ("tests",))
"""The house from the ground floor up: common/ (storage, queue, settings), the embedded models
and simulator, the stages and the CLI side by side, the tools (benchmarks, scripts, the docs'
hooks, the compose stand-ins), the tests. A folder imports only folders of a lower layer: none
of its own layer but itself."""
RANK = {folder: rank for rank, layer in enumerate(LAYERS) for folder in layer}
# Top-level folders that hold no source of ours (a virtual environment, built or fetched output).
NOT_SOURCE = {"site", "build", "dist", "export", "models", "demo-output", "node_modules"}


def _source_folders() -> set[str]:
    """Every top-level folder of the checkout with a Python file in it."""
    return {path.name for path in ROOT.iterdir()
            if path.is_dir() and not path.name.startswith((".", "_"))
            and path.name not in NOT_SOURCE and not path.name.endswith(".egg-info")
            and next(path.rglob("*.py"), None) is not None}


def _modules() -> dict[str, Path]:
    found = {}
    for folder in RANK:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The names an import statement reaches (its module and, for ``from``, each name in it); in
    a folder of scripts (no ``__init__.py``: the folder is on ``sys.path``) an absolute import
    may name a file beside it, so its name under the folder is reached too."""
    level = node.level if isinstance(node, ast.ImportFrom) else 0
    if isinstance(node, ast.Import):
        bases, names = [alias.name for alias in node.names], []
    else:
        base = node.module or ""
        if level:
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[:len(package) - level + 1]
            base = ".".join([*package, base] if base else package)
        bases, names = [base], [alias.name for alias in node.names]
    folder = MODULES[module].parent
    scripts = not level and not (folder / "__init__.py").is_file()
    for base in bases:
        beside = ".".join([*folder.relative_to(ROOT).parts, base])
        for name in [base, beside] if scripts else [base]:
            yield name
            yield from (f"{name}.{alias}" for alias in names)


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each module's imports of our modules (anywhere in the file, lazy ones too), and the
    modules of a layer above its own (or beside it) it names in a string constant (an entry
    point, a ``-m`` module)."""
    imports: dict[str, set[str]] = {m: set() for m in MODULES}
    strings: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                imports[module] |= {t for t in _imported(module, node) if t in MODULES} - {module}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = node.value.split(":")[0]
                if named in MODULES and "." in named and not _allowed(module, named):
                    strings[module].add(named)
    return imports, strings


def _folder(module: str) -> str:
    return module.split(".")[0]


def _allowed(src: str, dst: str) -> bool:
    """Whether module ``src`` may import ``dst``: its own folder, or one of a lower layer."""
    return _folder(src) == _folder(dst) or RANK[_folder(dst)] < RANK[_folder(src)]


IMPORTS, STRINGS = _graph()


def _upward() -> list[str]:
    """Every import from a folder to one of its own layer or a higher one."""
    return sorted(f"{m} -> {t}" for m, targets in IMPORTS.items() for t in targets
                  if not _allowed(m, t))


def _edges(src: str, dst: str) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in IMPORTS.items() if m.split(".")[0] == src
                  for t in targets if t.split(".")[0] == dst)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in IMPORTS[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    return found


def test_every_folder_holding_python_has_a_layer() -> None:
    assert _source_folders() == set(RANK), "give a new folder its place in LAYERS"
    architecture = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    assert " < ".join(" | ".join(layer) for layer in LAYERS) in architecture, \
        "the page states the layers' order"


def test_no_folder_imports_one_above_or_beside_it() -> None:
    assert _upward() == []


# Names that only recognise a process (doctor finds engines by their supervisor's module in a
# command line); nothing is imported or run from them here.
RECOGNISED = {"common.engine.leftovers": ["workers.generate.engines.supervisor"]}


def test_no_folder_names_a_module_above_or_beside_it() -> None:
    """A string naming a higher module (``"workers.x:attr"``, ``-m workers.x``) is an import
    the graph would not see: none but the recognised, so the CLI names no stage module."""
    assert {m: sorted(s) for m, s in STRINGS.items() if s} == RECOGNISED


def test_the_ground_floor_imports_nothing_above_it() -> None:
    """The rule's plainest case, spelt out: common/ imports none of the folders above it, and
    the stages and the CLI none of each other."""
    assert [e for folder in ("embedded", "workers", "producer", "tests")
            for e in _edges("common", folder)] == []
    assert _edges("workers", "producer") + _edges("producer", "workers") == []


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_the_stage_skeleton_imports_nothing_from_generate() -> None:
    seen, todo = set(), ["workers.stage"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(IMPORTS[module])
    assert sorted(m for m in seen if m.startswith("workers.generate")) == []


@pytest.mark.parametrize("group", [COMMANDS, WORKER_COMMANDS])
def test_the_entry_points_are_declared_and_load_to_click_commands(group: str) -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[group], group
    for name, target in declared[group].items():
        module, _, attr = target.partition(":")
        assert module.split(".")[0] == "workers" and module in MODULES, target
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command) and command.name == name, target
    installed = {ep.name: ep.value for dist in importlib.metadata.distributions()
                 for ep in dist.entry_points.select(group=group)}
    assert installed == declared[group], "stale package metadata: run pip install -e ."


def test_the_embedded_models_builder_reaches_common_by_its_entry_point() -> None:
    """common/ knows the embedded models' names (a closed set it owns) and loads their builder
    by name; embedded/ registers it and builds exactly those names."""
    import tomllib

    from common.choices import TinyModel
    from common.engine.models import tiny_builder
    from embedded.tinyconsts import TINY_MODEL_VERSIONS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = declared[MODEL_BUILDERS][TINY_BUILDER]
    module, _, attr = target.partition(":")
    assert _folder(module) == "embedded" and module in MODULES, target
    assert tiny_builder() is getattr(importlib.import_module(module), attr)
    installed = {ep.name: ep.value for dist in importlib.metadata.distributions()
                 for ep in dist.entry_points.select(group=MODEL_BUILDERS)}
    assert installed == declared[MODEL_BUILDERS], "stale package metadata: run pip install -e ."
    assert list(TINY_MODEL_VERSIONS) == [m.value for m in TinyModel]


def test_help_lists_every_command() -> None:
    from producer.cli import main

    declared = {ep.name for dist in importlib.metadata.distributions()
                for ep in dist.entry_points.select(group=COMMANDS)}
    result = subprocess.run([sys.executable, "-m", "producer.cli", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines()
              if line.startswith("  ") and line.split()}
    assert declared <= listed and set(main.list_commands(click.Context(main))) == listed
    worker = subprocess.run([sys.executable, "-m", "producer.cli", "worker", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 0, worker.stderr
    assert all(f"  {kind} " in worker.stdout for kind in ("generate", "hidden", "train"))


def test_a_command_that_fails_to_load_is_one_clear_error() -> None:
    from click.testing import CliRunner

    from common.entry_points import EntryPointGroup

    @click.group(cls=EntryPointGroup, entry_group="dflash_pipeline.test")
    def group() -> None:
        """A group with one broken entry point."""

    group.__dict__["entry_points"] = {"broken": importlib.metadata.EntryPoint(
        "broken", "workers.no_such_module:command", "dflash_pipeline.test")}
    result = CliRunner().invoke(group, ["broken", "--help"])
    assert result.exit_code == 1, result.output
    assert "command 'broken' failed to load from entry point 'workers.no_such_module:command'" \
        in result.output and "ModuleNotFoundError" in result.output
    empty = click.group(cls=EntryPointGroup, entry_group="dflash_pipeline.test")(group.callback)
    empty.__dict__["entry_points"] = {}
    result = CliRunner().invoke(empty, ["worker"])
    assert result.exit_code == 2 and "pip install -e ." in result.output, result.output


def test_the_launcher_names_no_stage() -> None:
    """Each stage's command hands the launcher its own Launch (queue, app, preflight, argv)."""
    stages = ("workers.generate", "workers.hidden", "workers.train")
    assert not [t for t in IMPORTS["workers.launch"] if t.startswith(stages)]
    named = [node.value for node in ast.walk(ast.parse(MODULES["workers.launch"].read_text()))
             if isinstance(node, ast.Constant) and node.value in ("generate", "hidden", "train")]
    assert named == []


# common/ keeps at its top what every part of it and of the tree uses; the rest lives in the
# folder of what it owns, the folders in an order (docs/concepts/architecture.md shows it): a
# folder imports the top and the folders before it, never one after it, so no two folders
# depend on each other.
COMMON_ROOT = {"choices", "config", "config_fields", "config_sections",
               "declared", "errors", "exit_codes", "entry_points", "storage", "json_parse",
               "row_caps", "storage_api", "s3_storage", "reads", "keys", "key_layout",
               "lifeline", "faults"}
COMMON_ORDER = ("engine", "gates", "inputs", "drafter", "runs", "queue", "monitor", "hidden",
                "plan", "cli")


def _common_part(module: str) -> str | None:
    """A common/ module's folder, "" for one at common/'s top, None outside common/."""
    parts = module.split(".")
    if parts[0] != "common" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in COMMON_ORDER else ""


def _order_breaks() -> list[str]:
    """Imports inside common/ that reach a later folder (or, from its top, any folder)."""
    rank = {"": -1, **{folder: n for n, folder in enumerate(COMMON_ORDER)}}
    return sorted(f"{m} -> {t}" for m, targets in IMPORTS.items() for t in targets
                  if (src := _common_part(m)) is not None and (dst := _common_part(t))
                  is not None and src != dst and rank[dst] > rank[src])


def test_common_is_foldered_by_what_it_owns() -> None:
    top = {m.split(".")[1] for m in MODULES if m.startswith("common.")}
    assert top == COMMON_ROOT | set(COMMON_ORDER)
    for folder in COMMON_ORDER:
        assert (ROOT / "common" / folder / "__init__.py").is_file(), folder
    architecture = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    assert all(f"  {folder}/" in architecture for folder in COMMON_ORDER)
    assert " < ".join(COMMON_ORDER) in architecture, "the page states the folders' order"


def test_commons_folders_import_only_earlier_ones() -> None:
    assert _order_breaks() == []

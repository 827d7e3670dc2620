"""The CLI contract: every command, option, alias, default, environment name, required-ness and
accepted values checked in (tests/data/cli_contract.json, taken at 2991a6f before issue 68's
option rework) still exist with the same values; new ones may be added, none renamed or dropped.

To record an addition: ``python tests/test_cli_contract.py > tests/data/cli_contract.json``
"""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import Any

import click

SNAPSHOT = Path(__file__).parent / "data" / "cli_contract.json"
ROOT_NAME = "dflash-pipeline"


def _value(value: Any) -> Any:
    """A default or choice as JSON: enum members by value, click's UNSET as None."""
    if isinstance(value, enum.Enum):
        return None if type(value).__module__.startswith("click") else value.value
    if isinstance(value, (list, tuple)):
        return [_value(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _type(kind: click.ParamType[Any]) -> dict[str, Any]:
    """A parameter type's name, choices and bounds."""
    out: dict[str, Any] = {"name": kind.name}
    if isinstance(kind, click.Choice):
        out["choices"] = [_value(choice) for choice in kind.choices]
    for bound in ("min", "max", "min_open", "max_open", "clamp"):
        if hasattr(kind, bound):
            out[bound] = _value(getattr(kind, bound))
    return out


def _param(param: click.Parameter) -> dict[str, Any]:
    """What a user relies on in one parameter; an unset default as it acts (False, [], None)."""
    is_flag = isinstance(param, click.Option) and param.is_flag
    default = _value(param.default)
    if default is None and is_flag:
        default = False
    if default is None and param.multiple:
        default = []
    return {"kind": type(param).__name__, "opts": list(param.opts),
            "secondary_opts": list(param.secondary_opts), "envvar": param.envvar,
            "default": default, "required": param.required, "type": _type(param.type),
            "multiple": param.multiple, "nargs": param.nargs, "is_flag": is_flag,
            "count": isinstance(param, click.Option) and param.count}


def contract() -> dict[str, dict[str, dict[str, Any]]]:
    """Every command of the tree (entry-point commands included) by path, its params by name."""
    from producer.cli import main

    found: dict[str, dict[str, dict[str, Any]]] = {}

    def walk(command: click.Command, path: str, ctx: click.Context) -> None:
        found[path] = {param.name or "": _param(param) for param in command.params}
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None, f"{path} {name} lists but does not load"
                walk(sub, f"{path} {name}", click.Context(sub, parent=ctx, info_name=name))

    walk(main, ROOT_NAME, click.Context(main, info_name=ROOT_NAME))
    return found


def test_every_contracted_command_and_param_holds() -> None:
    old = json.loads(SNAPSHOT.read_text())
    now = contract()
    broken = []
    for path, params in old.items():
        if path not in now:
            broken.append(f"{path}: command gone")
            continue
        for name, want in params.items():
            got = now[path].get(name)
            if got is None:
                broken.append(f"{path} {want['opts']}: option gone")
                continue
            broken += [f"{path} {want['opts']} {key}: was {value!r}, now {got.get(key)!r}"
                       for key, value in want.items() if got.get(key) != value]
    assert not broken, "CLI contract broken:\n" + "\n".join(broken)


def test_snapshot_covers_the_tree() -> None:
    """The snapshot is not vacuous: it names the worker stages and the run and env options."""
    old = json.loads(SNAPSHOT.read_text())
    assert {f"{ROOT_NAME} worker {stage}" for stage in ("generate", "hidden", "train")} <= set(old)
    envvars = {param["envvar"] for params in old.values() for param in params.values()}
    assert {"DFLASH_RUN", "DFLASH_STORAGE", "DFLASH_VERBOSE"} <= envvars


if __name__ == "__main__":
    json.dump(contract(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")

"""A run's options are declared once (common/runs/options.py): enqueue's click options, the
settings reference and run.json's schema come from that declaration, a default is written in
one place, and a real run.json fits the generated schema."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import click
import jsonschema
import pytest

from common.declared import OPT
from common.engine.sampling import Sampling
from common.runs.json_schema import run_json_schema
from common.runs.options import DRAFTER_LAYERS, RunOptions
from common.runs.records import RunConfig
from producer.cli import main
from tests.conftest import MT_BENCH, ROOT, TinyTarget

PACKAGES = ("common", "producer", "workers", "embedded")
DECLARATION = Path("common/runs/options.py")
# The records whose defaults an option takes instead of restating them (sampling, gates).
RECORDS = ("common/engine/sampling.py", "common/gates/judge.py")
# Command flags of enqueue that are not run options: how it runs, not what the run is.
COMMAND_FLAGS = {"dry_run", "show", "model", "as_json", "storage", "broker_url", "verbose"}
UNSET = object()


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return UNSET   # a name, a call: it refers to a value declared elsewhere


def _default_sites(names: set[str]) -> list[tuple[Path, int, str, object]]:
    """Every parameter or class field named as a run option with a default, and that default
    as a literal (UNSET when it is an expression that names another declaration)."""
    sites = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                pairs: list[tuple[str, ast.expr]] = []
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    args = node.args
                    positional = args.posonlyargs + args.args
                    pairs += [(a.arg, d) for a, d in zip(
                        positional[len(positional) - len(args.defaults):], args.defaults,
                        strict=True)]
                    pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults,
                                                         strict=True) if d is not None]
                elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                      and node.value is not None):
                    pairs.append((node.target.id, node.value))
                for name, value in pairs:
                    if name in names:
                        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == \
                                "run_option":
                            if not value.args:   # a required option declares no default
                                continue
                            value = value.args[0]
                        sites.append((path.relative_to(ROOT), node.lineno, name,
                                      _literal(value)))
    return sites


def _effective_default(name: str) -> object:
    """The value a run takes when the option is not given: the declaration's, or, for an
    option that defers to the target, the sampling record's fallback."""
    declared = {f.name: f.default for f in fields(RunOptions)}[name]
    if declared is None and name in {f.name for f in fields(Sampling)}:
        return getattr(Sampling, name)
    return declared


def test_every_run_options_default_is_written_once() -> None:
    names = {f.name for f in fields(RunOptions)}
    sites = _default_sites(names)
    checked = 0
    for name in sorted(names):
        value = _effective_default(name)
        if value in (None, False, ()) or value is MISSING:
            continue   # "not given": nothing to restate
        checked += 1
        same = [(str(path), line) for path, line, site, literal in sites
                if site == name and literal is not UNSET and literal == value
                and type(literal) is type(value)]
        assert len(same) <= 1, f"--{name}'s default {value!r} is written at {same}"
        homes = {str(DECLARATION), *RECORDS}
        assert all(path in homes for path, _ in same), (
            f"--{name}'s default {value!r} is written at {same}, outside its declaration")
    assert checked >= 15


def _enqueue() -> click.Command:
    command = main.get_command(click.Context(main), "enqueue")
    assert command is not None
    return command


def test_enqueue_takes_exactly_the_declared_options_in_order() -> None:
    params = [p for p in _enqueue().params if isinstance(p, click.Option)]
    declared = [f.name for f in fields(RunOptions)]
    assert [p.name for p in params if p.name not in COMMAND_FLAGS] == declared
    by_name = {p.name: p for p in params}
    for f in fields(RunOptions):
        option = by_name[f.name]
        assert option.help == f.metadata[OPT].help
        assert option.envvar == f"DFLASH_{f.name.upper()}"
        if f.default not in (None, False) and not option.required:
            assert option.default == f.default, f.name


def test_the_schema_covers_run_json_and_every_frozen_option() -> None:
    schema = run_json_schema()
    assert set(schema["properties"]) == {f.name for f in fields(RunConfig)
                                         if not f.name.startswith("_")}
    described = json.dumps(schema)
    for f in fields(RunOptions):
        if f.name != "no_thinking":
            assert f.name in described, f"--{f.name} is frozen but run.json's schema omits it"


@pytest.mark.parametrize("drafter", [(), ("--drafter-layers", "3")])
def test_a_real_run_json_fits_the_generated_schema(
        tmp_path: Path, model_cache: Path, target_model: TinyTarget,
        drafter: tuple[str, ...]) -> None:
    from common.storage import open_storage

    storage = tmp_path / "storage"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(model_cache), "DFLASH_MODEL": target_model.name,
           "DFLASH_STORAGE": str(storage), "DFLASH_BROKER_URL": "redis://127.0.0.1:1/0"}
    done = subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--run", "r",
                           "--input", str(MT_BENCH), "--limit", "4", "--dry-run", "--json",
                           *drafter], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    from common.config import load_settings
    from producer.commands import build_run_config

    settings_env = {k: v for k, v in env.items() if k.startswith("DFLASH_")}
    layers = int(drafter[1]) if drafter else DRAFTER_LAYERS
    config = build_run_config(load_settings(settings_env),
                              RunOptions(run="r", input=(str(MT_BENCH),), limit=4,
                                      drafter_layers=layers))
    written = json.loads(json.dumps(config.to_json()))
    jsonschema.validate(written, run_json_schema())
    assert RunConfig.from_json(written) == config
    assert written["drafter"]["config"]["num_hidden_layers"] == layers
    assert json.loads(done.stdout)["drafter"]["kind"] == "default"
    bad = {**written, "shard_size": "many"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, run_json_schema())
    assert not open_storage(str(storage)).exists("runs/r/run.json")   # a dry run writes nothing


@pytest.mark.parametrize("args", [("--temperature", "nan"), ("--temperature", "inf"),
                                  ("--min-p", "nan"), ("--max-reject-rate", "nan")])
def test_a_number_option_refuses_what_is_no_finite_number(args: tuple[str, str]) -> None:
    """click's FloatRange lets NaN past every bound; the options refuse it at the edge."""
    from click.testing import CliRunner

    from producer.cli import main

    result = CliRunner().invoke(main, ["enqueue", "--input", "x.jsonl", "--run", "r", *args])
    assert result.exit_code == 2 and "is not a finite number" in result.output, result.output

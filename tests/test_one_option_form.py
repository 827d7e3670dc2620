"""Every option has one declaration form (issue 68): no raw ``click.option`` outside common/cli/,
shared options declared once, and a run option another command takes keeps its declaration."""

from __future__ import annotations

import ast
from dataclasses import fields

import click
from click.testing import CliRunner

from common.cli.options import CliOptions
from common.declared import declared
from common.runs.options import RunOptions
from producer.cli import main
from tests.conftest import ROOT

FOLDERS = ("common", "workers", "producer")


def _raw_options(path_text: str) -> list[int]:
    """Lines of ``click.option(...)`` (or an ``option`` imported from click) in a module."""
    tree = ast.parse(path_text)
    from_click = {alias.asname or alias.name for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module == "click"
                  for alias in node.names if alias.name == "option"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "option"
                and isinstance(func.value, ast.Name) and func.value.id == "click") or (
                isinstance(func, ast.Name) and func.id in from_click):
            found.append(node.lineno)
    return found


def test_no_raw_click_option_outside_common_cli() -> None:
    raw = [f"{path.relative_to(ROOT)}:{line}" for folder in FOLDERS
           for path in sorted((ROOT / folder).rglob("*.py"))
           if (ROOT / "common" / "cli") not in path.parents
           for line in _raw_options(path.read_text())]
    assert not raw, f"declare these options (common.declared.opt, options_for): {raw}"


def test_the_scan_finds_a_raw_option() -> None:
    assert _raw_options("import click\n@click.option('--x')\ndef f(x): ...\n") == [2]
    assert _raw_options("from click import option as o\n@o('--x')\ndef f(x): ...\n") == [2]
    assert _raw_options("@options_for('status')\ndef f(x): ...\n") == []


def test_json_is_declared_once_and_reaches_its_commands() -> None:
    found = declared(next(f for f in fields(CliOptions) if f.name == "as_json"))
    assert found is not None and "--json" in found.decls
    runner = CliRunner()
    for command in found.commands:
        shown = runner.invoke(main, [*command.split(), "--help"], terminal_width=200).output
        assert "--json" in shown, command
    assert "--json" not in runner.invoke(main, ["demo", "--help"]).output


def test_resume_takes_the_gate_options_as_run_options_declare_them() -> None:
    resume = main.get_command(None, "resume")   # type: ignore[arg-type]
    enqueue = main.get_command(None, "enqueue")   # type: ignore[arg-type]
    assert resume is not None and enqueue is not None
    for name in ("max_reject_rate", "pause_after"):
        field = next(f for f in fields(RunOptions) if f.name == name)
        found = declared(field)
        assert found is not None
        at_resume = next(p for p in resume.params if p.name == name)
        at_enqueue = next(p for p in enqueue.params if p.name == name)
        assert at_resume.help == at_enqueue.help == found.help
        assert repr(at_resume.type) == repr(at_enqueue.type) == repr(found.click["type"])
        # resume keeps the run's threshold unless given: no default, no variable.
        assert at_resume.default is None and at_resume.envvar is None
        assert at_enqueue.default == field.default
    result = CliRunner().invoke(main, ["resume", "--run", "r", "--max-reject-rate", "2"])
    assert result.exit_code == 2 and "0<=x<=1" in result.output


def test_a_setting_takes_its_help_from_its_declaration() -> None:
    from common.config import FIELDS

    _, f = FIELDS["max_in_flight"]
    found = declared(f)
    assert found is not None and {"worker generate", "bench"} <= set(found.commands)
    shown = CliRunner().invoke(main, ["worker", "generate", "--help"],
                               terminal_width=200).output
    assert found.help in shown and "DFLASH_MAX_IN_FLIGHT" in shown


def test_run_is_declared_once_and_read_per_command_as_the_declaration_says() -> None:
    field = next(f for f in fields(RunOptions) if f.name == "run")
    found = declared(field)
    assert found is not None

    def run_of(command: str) -> click.Option:
        cmd = main.get_command(click.Context(main), command)
        assert cmd is not None
        return next(p for p in cmd.params if isinstance(p, click.Option) and p.name == "run")

    for command in ("enqueue", "resume", "status", "export-dataset", "export-drafter"):
        assert run_of(command).required and run_of(command).envvar == "DFLASH_RUN", command
        assert run_of(command).help == found.help
    for command in ("bench", "plan-storage", "plan-training"):
        assert not run_of(command).required and run_of(command).envvar == "DFLASH_RUN"
        assert run_of(command).help == found.at[command]["help"]
    demo = run_of("demo")
    assert demo.default == "mt-bench-demo" and demo.envvar is None and not demo.required

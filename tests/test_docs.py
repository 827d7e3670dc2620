"""The README is a front page and the docs site's references come from the code.

`scripts/test.sh` builds the site with ``mkdocs build --strict`` (a broken link, a missing page or
a failing reference fails it); these tests hold the parts that a build cannot see: the README's
length, links and table of commands, and the generated settings reference covering every setting.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from common.cli import options as command_options
from common.config import FIELDS, env_name
from tests.conftest import ROOT

HOOKS = ROOT / "docs" / "hooks"
README = ROOT / "README.md"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name: str) -> ModuleType:
    """A module of docs/hooks, imported as the MkDocs build imports it (its folder on the path)."""
    if str(HOOKS) not in sys.path:
        sys.path.insert(0, str(HOOKS))
    spec = importlib.util.spec_from_file_location(name, HOOKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert text.splitlines()[2:5] == [
        "```bash",
        "bash scripts/demo.sh     # the whole product on the embedded CPU model: regenerate, "
        "train, measure, export",
        "bash scripts/test.sh     # run the tests (starts its own redis-server, S3 server, "
        "workers and SGLang)",
    ]
    assert "acceptance length tau" in text and "lossless 16/16" in text


def test_readme_links_point_at_pages_that_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) >= 20
    assert [link for link in local if not (ROOT / link).is_file()] == []
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(link.removeprefix("docs/") in nav for link in local if link.startswith("docs/"))


def test_readme_lists_every_command_with_its_own_help() -> None:
    """The README's table holds each command once, described by its --help's first paragraph."""
    summaries = load("cli_group").summaries()
    rows = dict(re.findall(r"^\| `([a-z -]+)` \| (.+) \|$", README.read_text(), re.M))
    assert rows == summaries
    assert {"enqueue", "worker generate", "worker train", "eval-drafter"} <= set(rows)


def test_the_command_group_for_the_docs_holds_every_command() -> None:
    """mkdocs-click documents the group's ``commands``: the entry-point ones are loaded in."""
    from click.testing import CliRunner

    from producer.cli import main

    cli = load("cli_group").cli
    listed = main.list_commands(None)  # what `dflash-pipeline --help` lists
    assert sorted(cli.commands) == sorted(listed)
    assert sorted(cli.commands["worker"].commands) == ["generate", "hidden", "train"]
    assert "eval-drafter" not in main.commands  # still loaded lazily by the CLI itself
    help_text = CliRunner().invoke(main, ["--help"]).output
    assert all(name in help_text for name in cli.commands)


def test_settings_reference_names_every_setting_and_option() -> None:
    text = load("references").settings_markdown()
    for flat in [*FIELDS, *command_options.OPTIONS]:
        row = re.search(rf"^\| `{flat}` \| `{env_name(flat)}` \| (.*)$", text, re.M)
        assert row is not None, flat
    # Defaults and options as declared: the CLI option found by its variable, the home shown as ~.
    assert re.search(r"^\| `gpu` \| `DFLASH_GPU` \| `0` \| `--gpu` \(worker generate, worker "
                     r"hidden, worker train\)", text, re.M)
    assert "| `cache_dir` | `DFLASH_CACHE_DIR` | `~/.cache/dflash-pipeline` |" in text
    assert "| `ui_auth` | `DFLASH_UI_AUTH` | (unset) |" in text
    assert str(Path.home()) not in text


def test_field_comments_are_read_from_the_declaration() -> None:
    from common.config import GenerateSettings

    comments = load("references").field_comments(GenerateSettings)
    assert comments["engine_drain_timeout"].startswith("On a stop SGLang finishes")  # above it
    assert comments["engine_port"] == "the SGLang server of GPU N listens on this + N"  # beside
    assert comments["tp"] == ""


@pytest.mark.parametrize("image", ["dashboard.png", "dashboard-paused.png", "report.png"])
def test_the_docs_pictures_are_committed_pngs(image: str) -> None:
    # Taken by the tests from real runs: tests/test_ui_browser.py and tests/test_demo.py.
    assert (ROOT / "docs" / "img" / image).read_bytes()[:8] == PNG_MAGIC

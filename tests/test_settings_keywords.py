"""Settings' keywords are typed: one per section and declared setting, each with its field's
type, so the checker refuses a misspelt keyword or a value of the wrong type before it runs."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from common.config import SECTIONS, SettingOverrides, SettingValues, section_fields
from tests.conftest import ROOT


def _declared() -> dict[str, object]:
    """Every keyword Settings takes at run time, with its declared type."""
    found: dict[str, object] = {name: cls for name, cls in SECTIONS.items()}
    for cls in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        found |= {flat: hints[f.name] for flat, f in section_fields(cls)}
    return found


def _lines(keywords: dict[str, object]) -> list[str]:
    return [f"{name}: {getattr(kind, '__name__', kind)}" for name, kind in keywords.items()]


def test_the_keywords_are_the_declared_settings_with_their_types() -> None:
    """A new setting's keyword is one line in each TypedDict; the failure names the lines."""
    declared = _declared()
    typed = typing.get_type_hints(SettingValues)
    assert typed == declared, ("common/config_keywords.py: SettingValues should have "
                               f"{sorted(set(_lines(declared)) - set(_lines(typed)))}, "
                               f"not {sorted(set(_lines(typed)) - set(_lines(declared)))}")
    flat = {name: kind | None for name, kind in declared.items() if name not in SECTIONS}
    overrides = typing.get_type_hints(SettingOverrides)
    assert overrides == flat, ("common/config_keywords.py: SettingOverrides should have "
                               f"{sorted(set(_lines(flat)) - set(_lines(overrides)))}, "
                               f"not {sorted(set(_lines(overrides)) - set(_lines(flat)))}")


SNIPPET = """\
from common.choices import MtpMode
from common.config import Settings, load_settings

settings = Settings(train_nnodes=2, mtp=MtpMode.OFF)
moved = settings.replace({keyword}="m")
loaded = load_settings({{}}, storage=None, {keyword}="m")
"""


def _mypy(tmp_path: Path, keyword: str) -> subprocess.CompletedProcess[str]:
    snippet = tmp_path / f"snippet_{keyword}.py"
    snippet.write_text(SNIPPET.format(keyword=keyword))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
         "--config-file", str(ROOT / "pyproject.toml"), str(snippet)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("keyword", ["modle", "train_node"])
def test_the_checker_refuses_a_misspelt_keyword(tmp_path: Path, keyword: str) -> None:
    result = _mypy(tmp_path, keyword)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f'Unexpected keyword argument "{keyword}" for "replace" of "Settings"' \
        in result.stdout, result.stdout
    assert f'Unexpected keyword argument "{keyword}" for "load_settings"' in result.stdout
    assert "Found 2 errors in 1 file" in result.stdout, result.stdout


def test_the_checker_takes_the_right_keyword_and_refuses_a_wrong_type(tmp_path: Path) -> None:
    result = _mypy(tmp_path, "model")
    assert result.returncode == 0, result.stdout + result.stderr
    wrong = _mypy(tmp_path, "train_nnodes")   # an int setting given a str
    assert wrong.returncode == 1 and 'Argument "train_nnodes" to "replace" of "Settings" has ' \
        'incompatible type "str"; expected "int"' in wrong.stdout, wrong.stdout

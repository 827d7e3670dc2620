"""Settings' keywords are typed from their declarations (scripts/mypy_settings.py, the mypy plugin
pyproject.toml loads): one per section and declared setting, each with its field's type, so the
checker refuses a misspelt keyword or a value of the wrong type before it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SNIPPET = """\
from common.choices import MtpMode
from common.config import Settings, load_settings

settings = Settings(train_nnodes=2, mtp=MtpMode.OFF)
moved = settings.replace({keyword}="m")
built = Settings({keyword}="m")
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
    assert f'Unexpected keyword argument "{keyword}" for "Settings"' in result.stdout
    assert "Found 3 errors in 1 file" in result.stdout, result.stdout


def test_the_checker_takes_the_right_keyword_and_refuses_a_wrong_type(tmp_path: Path) -> None:
    result = _mypy(tmp_path, "model")
    assert result.returncode == 0, result.stdout + result.stderr
    wrong = _mypy(tmp_path, "train_nnodes")   # an int setting given a str
    assert wrong.returncode == 1 and 'Argument "train_nnodes" to "replace" of "Settings" has ' \
        'incompatible type "str"; expected "int"' in wrong.stdout, wrong.stdout

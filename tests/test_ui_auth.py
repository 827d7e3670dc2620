"""The dashboard's basic auth, and its refusal to listen beyond loopback without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from producer.demo import free_port
from tests.conftest import ROOT
from tests.ui_support import running_ui


def _env(tmp_path: Path) -> dict[str, str]:
    # Redis need not be up: the dashboard serves storage's figures without it.
    return {**os.environ, "DFLASH_STORAGE": str(tmp_path / "storage"),
            "DFLASH_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}


def test_requests_without_the_password_get_401(tmp_path: Path) -> None:
    with running_ui(_env(tmp_path), tmp_path / "ui.log", auth="admin:s3cret") as ui:
        for path in ("/", "/api/runs", "/api/runs/x/status", "/static/app.js"):
            status, _ = ui.get(path, auth="")
            assert status == 401, path
            assert ui.get(path, auth="admin:wrong")[0] == 401, path
        assert ui.get("/static/app.js")[0] == 200
        assert json.loads(ui.get("/api/runs")[1]) == {"runs": []}
        assert ui.get("/api/runs/nope/status")[0] == 404


def _ui(tmp_path: Path, *args: str, auth: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "ui", *args],
                          env={**_env(tmp_path), "DFLASH_UI_AUTH": auth}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_binding_beyond_loopback_without_auth_exits_1(tmp_path: Path) -> None:
    result = _ui(tmp_path, "--host", "0.0.0.0", "--port", str(free_port()))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: refusing to serve the dashboard on 0.0.0.0 without auth: set "
        "DFLASH_UI_AUTH=user:password, or use --host 127.0.0.1"]
    bad = _ui(tmp_path, "--host", "0.0.0.0", auth="no-colon")
    assert bad.returncode == 1 and bad.stderr.strip() == \
        "error: DFLASH_UI_AUTH must be user:password"


def test_any_host_with_auth_is_served(tmp_path: Path) -> None:
    with running_ui(_env(tmp_path), tmp_path / "ui.log", "--host", "0.0.0.0",
                    auth="admin:s3cret") as ui:
        assert ui.get("/api/runs", auth="")[0] == 401
        assert ui.get("/api/runs")[0] == 200


def test_the_env_examples_placeholder_password_is_refused_with_one_line(tmp_path: Path) -> None:
    """compose's .env copied from .env.example and never edited: the dashboard does not start,
    on loopback either."""
    for host in ("0.0.0.0", "127.0.0.1"):
        result = _ui(tmp_path, "--host", host, "--port", str(free_port()),
                     auth="admin:change-me-ui")
        assert result.returncode == 1, result.stdout
        assert result.stderr.strip().splitlines() == [
            "error: DFLASH_UI_AUTH's password is still .env.example's placeholder "
            "(change-me-...): set a password of your own (UI_PASSWORD in compose's .env)"]

"""`doctor` says which kernels a hybrid target's Gated DeltaNet layers run on here, and warns on
transformers' torch fallback; a dense target gets no such row."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from common.config import load_settings
from producer.doctor.command import run_checks
from producer.doctor.kernels import NAME, check_linear_attention_kernels

pytestmark = pytest.mark.usefixtures("model_cache")


def _rows(model: str, cache: Path) -> list:
    return check_linear_attention_kernels(load_settings(model=model, cache_dir=cache))


def test_a_dense_target_needs_no_linear_attention_kernels(model_cache: Path) -> None:
    assert _rows("tiny-qwen3", model_cache) == []


def test_the_hybrid_target_on_this_host_runs_the_torch_fallback(model_cache: Path) -> None:
    import importlib.util

    rows = _rows("tiny-qwen3.5", model_cache)
    assert [r.status for r in rows] == ["WARN", "WARN"]
    for row, package in zip(rows, ("flash-linear-attention", "causal-conv1d"), strict=True):
        assert row.name == NAME and package in row.detail and "torch fallback" in row.detail
        if importlib.util.find_spec(package.replace("-", "_")) is None:
            assert "not installed" in row.detail and "pip install" in row.fix
    # The same rows in doctor's whole report.
    report = run_checks(load_settings(model="tiny-qwen3.5", cache_dir=model_cache,
                                      broker_url="redis://127.0.0.1:1/0"), None)
    assert [r.detail for r in report if r.name == NAME] == [r.detail for r in rows]


def test_an_installed_kernel_package_without_cuda_still_warns(model_cache: Path,
                                                              tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """fla importable but no CUDA device: its kernels cannot run here, and doctor says so."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fla", None)
    rows = _rows("tiny-qwen3.5", model_cache)
    assert "no CUDA device here" in rows[0].detail and rows[0].warn

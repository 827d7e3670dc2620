"""benchmarks/gpu_check.py's CPU smoke runs, dense and hybrid: each completes and prints its table.

Run: ``pytest tests/test_gpu_check.py -q`` (the real runs are on a GPU host, see
docs/reference/benchmarks.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PARTS = ["a extraction", "a extraction", "b train step", "b train step",
         "c spec-decoding", "c spec-decoding", "d mask numerics", *["f memory plan"] * 4]


@pytest.mark.parametrize("target", ["qwen3-8b", "qwen3.6-27b"])
def test_cpu_tiny_smoke_run_prints_the_table(target: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}   # tiny tensors; the machine is shared
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu",
                             "--tiny", "--target", target], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("part "))
    assert [c.strip() for c in lines[header].split("|")] == [
        "part", "case", "tokens/s", "peak GiB", "check", "ok"]
    body = [line for line in lines[header + 2:] if " | " in line]
    parts = [line.split("|")[0].strip() for line in body]
    assert "tokens equal to greedy" in result.stdout      # lossless on both shapes
    assert result.stdout.count("x measured)") == 4         # the plan beside the measurement
    assert all(line.rstrip().endswith("| ok") for line in body)
    if target == "qwen3-8b":
        assert parts == PARTS
        return
    assert "target tiny hybrid (3 linear : 1 full)" in lines[0]
    assert parts == [*PARTS, "e linear attention"]
    assert "delta rule: torch fallback, conv: torch fallback" in body[-1]  # no kernels here

"""benchmarks/gpu_check.py's CPU smoke run: it completes and prints its one table.

Run: ``pytest tests/test_gpu_check.py -q`` (the real run is on a GPU host, see README).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_cpu_tiny_smoke_run_prints_the_table() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}   # tiny tensors; the machine is shared
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu",
                             "--tiny"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("part "))
    assert [c.strip() for c in lines[header].split("|")] == [
        "part", "case", "tokens/s", "peak GiB", "check", "ok"]
    parts = [line.split("|")[0].strip() for line in lines[header + 2:]]
    assert parts == ["a extraction", "a extraction", "b train step", "b train step",
                     "c spec-decoding", "c spec-decoding", "d mask numerics"]
    assert "tokens equal to greedy" in result.stdout
    assert all(line.rstrip().endswith("| ok") for line in lines[header + 2:])

"""NVML checks without a GPU: a stand-in ``pynvml`` module drives their logic, and the real one
(when installed) must report "no NVIDIA driver".

Run: ``pytest tests/test_nvml.py -q``.
"""

from __future__ import annotations

import subprocess
import sys
import types

import psutil
import pytest

from common.engine.preflight import (
    NoNvidiaDriver,
    check_gpu_clean,
    gpu_memory_used_mib,
    gpu_processes,
)
from tests.conftest import wait_until


def test_nvml_absent_reports_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(NoNvidiaDriver, match="no NVIDIA driver"):
        gpu_processes(0)
    with pytest.raises(NoNvidiaDriver):
        gpu_memory_used_mib(0)
    result = check_gpu_clean(0)
    assert result.ok and result.status == "WARN"
    assert result.detail.startswith("no NVIDIA driver: only --engine cpu can run")
    assert "nvidia-ml-py" in result.fix
    assert check_gpu_clean(0, require_driver=True).status == "FAIL"


def test_real_nvml_without_driver() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    result = check_gpu_clean(0)
    assert result.status == "WARN" and result.detail.startswith("no NVIDIA driver")


class FakeNvml(types.ModuleType):
    """A stand-in for pynvml: one GPU with the given processes and memory use."""

    class NVMLError(Exception):
        pass

    def __init__(self, procs: list[tuple[int, int]], used_mib: int) -> None:
        super().__init__("pynvml")
        self.procs, self.used = procs, used_mib * 2**20

    def nvmlInit(self) -> None:  # pynvml spells them this way
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m * 2**20) for p, m in self.procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list:
        return []


def test_gpu_clean_check_names_foreign_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        # Right after fork the child has not exec'd sleep yet; name it once it has.
        wait_until(lambda: psutil.Process(sleeper.pid).cmdline() == ["sleep", "300"], 10,
                   "the sleeper to exec")
        monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([(sleeper.pid, 5000)], 5200))
        result = check_gpu_clean(0)
        assert result.status == "FAIL"
        assert f"pid {sleeper.pid} (5000 MiB): sleep 300" in result.detail
        assert f"kill {sleeper.pid}" in result.fix
        assert check_gpu_clean(0, own_pids={sleeper.pid}).status == "PASS"
    finally:
        sleeper.kill()
        sleeper.wait()
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([], 8000))
    assert "NVML does not list" in check_gpu_clean(0).detail
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([], 300))
    assert check_gpu_clean(0).status == "PASS"
    assert check_gpu_clean(3).status == "FAIL"  # no such GPU


class FakeNvmlHost(FakeNvml):
    """FakeNvml with what doctor's GPU-host rows read: driver version, name, free/total."""

    def __init__(self, free_gib: float, total_gib: float = 141.0) -> None:
        super().__init__([], 0)
        self.free, self.total = int(free_gib * 2**30), int(total_gib * 2**30)

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"580.65.06"

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=self.total - self.free, free=self.free,
                                     total=self.total)


def test_gpu_host_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from producer.doctor.gpu_host import check_nvml

    monkeypatch.setitem(sys.modules, "pynvml", None)
    [row] = check_nvml()
    assert row.status == "WARN" and row.detail.startswith("no NVIDIA driver")
    assert "nvidia-ml-py" in row.fix
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvmlHost(free_gib=139.5))
    nvml, gpu = check_nvml()
    assert (nvml.status, nvml.detail) == ("PASS", "driver 580.65.06, 1 GPU(s)")
    assert (gpu.name, gpu.status) == ("gpu 0 memory", "PASS")
    assert gpu.detail == "NVIDIA H200: 139.5 of 141.0 GiB free"
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvmlHost(free_gib=20))
    assert check_nvml()[1].status == "WARN"

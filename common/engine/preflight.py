"""Preflight checks shared by ``dflash-pipeline doctor`` and the generate worker.

Each check returns a :class:`CheckResult` instead of raising, so a caller can run them all and
show every problem at once::

    from common.engine.preflight import check_gpu_clean, check_redis
    for result in [*check_redis("redis://127.0.0.1:6379/0"), check_gpu_clean(0, own_pids=())]:
        print(result.status, result.name, result.detail, result.fix)

NVML comes from ``nvidia-ml-py`` (the ``gpu`` extra), imported only when a GPU is queried; without
it or without a driver the GPU checks say "no NVIDIA driver" (the CPU engine needs neither).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from common.config import mask_url
from common.errors import DflashError

log = logging.getLogger(__name__)

GIB = 1024**3
NO_DRIVER = "no NVIDIA driver"


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict; ``warn`` marks a pass that still deserves attention."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False

    @property
    def status(self) -> str:
        return "FAIL" if not self.ok else "WARN" if self.warn else "PASS"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


class NoNvidiaDriver(DflashError):
    """NVML cannot be used here: nvidia-ml-py is missing or no NVIDIA driver is loaded."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{NO_DRIVER} ({reason})")
        self.reason = reason


def no_driver_result(name: str, exc: NoNvidiaDriver, require_driver: bool) -> CheckResult:
    """The verdict without NVML: fine for the CPU engine, a failure when a GPU is required."""
    return CheckResult(name, ok=not require_driver, warn=True,
                       detail=f"{NO_DRIVER}: only --engine cpu can run ({exc.reason})",
                       fix="install the NVIDIA driver and `pip install nvidia-ml-py` (the gpu "
                           "extra) to use --engine sglang")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: int | None
    command: str


@contextmanager
def nvml_session() -> Iterator[Any]:
    """pynvml, initialised for the ``with`` block; NoNvidiaDriver when it cannot be."""
    try:
        import pynvml
    except ImportError as exc:
        raise NoNvidiaDriver("nvidia-ml-py is not installed") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NoNvidiaDriver(f"NVML: {exc}") from exc
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _handle(nvml: Any, gpu: int) -> Any:
    count = nvml.nvmlDeviceGetCount()
    if not 0 <= gpu < count:
        raise DflashError(f"GPU {gpu} does not exist (NVML sees {count} GPU(s))")
    return nvml.nvmlDeviceGetHandleByIndex(gpu)


def visible_gpus() -> list[int]:
    """NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES when it lists ints)."""
    with nvml_session() as nvml:
        count = nvml.nvmlDeviceGetCount()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    if listed and all(part.isdigit() for part in listed.split(",")):
        return [i for i in map(int, listed.split(",")) if i < count]
    return list(range(count))


def gpu_model(gpu: int) -> tuple[str, float]:
    """``gpu``'s name and total memory in GiB, as NVML reports them."""
    with nvml_session() as nvml:
        handle = _handle(nvml, gpu)
        name = nvml.nvmlDeviceGetName(handle)
        total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    return (name.decode() if isinstance(name, bytes) else str(name)), total / GIB


def gpu_memory_used_mib(gpu: int) -> int:
    """Memory in use on ``gpu`` by every process, in MiB."""
    with nvml_session() as nvml:
        return int(nvml.nvmlDeviceGetMemoryInfo(_handle(nvml, gpu)).used) // 2**20


def gpu_processes(gpu: int) -> list[GpuProcess]:
    """Compute and graphics processes holding ``gpu``, with their command lines when visible."""
    import psutil

    with nvml_session() as nvml:
        handle = _handle(nvml, gpu)
        raw = [*nvml.nvmlDeviceGetComputeRunningProcesses(handle),
               *nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)]
    found: dict[int, GpuProcess] = {}
    for proc in raw:
        used = getattr(proc, "usedGpuMemory", None)
        try:
            command = " ".join(psutil.Process(proc.pid).cmdline()) or "?"
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            # NVML reports host pids; inside a container they are often not visible.
            command = "(not visible from here)"
        found[proc.pid] = GpuProcess(proc.pid, None if used is None else used // 2**20, command)
    return list(found.values())


def check_gpu_clean(gpu: int, own_pids: Collection[int] = (), max_used_mib: int = 1024,
                    require_driver: bool = False) -> CheckResult:
    """Fail if processes other than ``own_pids`` hold ``gpu`` or it has memory in use."""
    name = f"gpu {gpu}"
    try:
        procs = gpu_processes(gpu)
        used = gpu_memory_used_mib(gpu)
    except NoNvidiaDriver as exc:
        return no_driver_result(name, exc, require_driver)
    except DflashError as exc:
        return CheckResult(name, ok=False, detail=str(exc), fix="pick a GPU index `nvidia-smi` "
                           "lists (--gpu / --gpus)")
    own = [p for p in procs if p.pid in own_pids]
    foreign = [p for p in procs if p.pid not in own_pids]
    # Our own engine's memory is expected; only what others hold counts against the GPU.
    other_mib = used - sum(p.used_mib or 0 for p in own)
    if foreign:
        listing = "; ".join(f"pid {p.pid} ({p.used_mib} MiB): {p.command[:120]}" for p in foreign)
        pids = " ".join(str(p.pid) for p in foreign)
        return CheckResult(name, ok=False, detail=f"{len(foreign)} foreign process(es) hold "
                           f"GPU {gpu}: {listing}", fix=f"stop them (kill {pids}) or use "
                           "another GPU; `nvidia-smi` shows who holds it")
    if other_mib > max_used_mib:
        return CheckResult(name, ok=False, detail=f"{other_mib} MiB in use on GPU {gpu} by "
                           "processes NVML does not list (another container?)",
                           fix="find the owner with `nvidia-smi` on the host, or use another GPU")
    return CheckResult(name, ok=True, detail=f"GPU {gpu}: {used} MiB in use, "
                       f"{len(own)} own process(es), no foreign ones")


def check_disk(name: str, path: Path, warn_gib: float = 10, fail_gib: float = 1) -> CheckResult:
    """Free space on the filesystem that holds ``path`` (or its nearest existing parent)."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / GIB
    detail = f"{free:.1f} GiB free at {path}"
    fix = f"free space on the filesystem of {probe} or point it elsewhere"
    if free < fail_gib:
        return CheckResult(name, ok=False, detail=detail, fix=fix)
    if free < warn_gib:
        return CheckResult(name, ok=True, warn=True, detail=detail, fix=fix)
    return CheckResult(name, ok=True, detail=detail)


def _scrub(text: str, url: str) -> str:
    """Mask the URL's password wherever an error message might echo it."""
    password = urlsplit(url).password
    text = mask_url(text)
    return text.replace(password, "***") if password else text


def _setting(key: str, value: str | None, wanted: str, risk: str) -> CheckResult:
    if value == wanted:
        return CheckResult(f"redis {key}", ok=True, detail=f"{key} {value}")
    return CheckResult(f"redis {key}", ok=True, warn=True, detail=f"{key} {value}: {risk}",
                       fix=f"`redis-cli CONFIG SET {key} {wanted}` and `{key} {wanted}` in "
                           "redis.conf")


def check_redis(url: str, timeout: float = 5.0) -> list[CheckResult]:
    """PING the broker, then check that it persists (AOF) and never evicts queued tasks."""
    import redis

    shown = mask_url(url)
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, decode_responses=True,
                                      socket_connect_timeout=timeout)
        client.ping()
        version = client.info("server").get("redis_version", "?")
    except (redis.RedisError, OSError, ValueError) as exc:
        return [CheckResult("redis", ok=False, detail=f"cannot reach {shown}: "
                            f"{_scrub(str(exc), url)}", fix="start Redis (`redis-server "
                            "--appendonly yes`) or set --broker-url / DFLASH_BROKER_URL")]
    results = [CheckResult("redis", ok=True, detail=f"PONG from {shown} (Redis {version})")]
    try:
        appendonly = client.config_get("appendonly").get("appendonly", "?")
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy", "?")
    except redis.RedisError as exc:
        # Managed Redis services often disable CONFIG; the settings cannot be verified then.
        return [*results, CheckResult("redis config", ok=True, warn=True,
                                      detail=f"CONFIG GET refused: {_scrub(str(exc), url)}",
                                      fix="make sure the server has appendonly yes and "
                                          "maxmemory-policy noeviction")]
    return [*results,
            _setting("appendonly", appendonly, "yes", "queued tasks are lost if Redis restarts"),
            _setting("maxmemory-policy", policy, "noeviction",
                     "Redis may evict queued tasks under memory pressure")]

"""Engine servers on this host that no live worker owns, for ``doctor``.

A generate worker starts its engine under a supervisor (a process-group leader) that kills the
engine's tree when the worker dies, and records the supervisor and itself (the owner) in a pid
file (``DFLASH_CACHE_DIR/engines/engine-PORT.pid``). An engine outlives its worker only when that
supervisor could not act (killed with ``kill -9``, or stopped with SIGSTOP, first): then the pid
file names an owner that is gone, or a dead supervisor, while the process group lives on.
SGLang servers that run under no supervisor at all (started by hand, or by a worker of an older
release) are listed too, since a worker cannot tell one it serves through ``--engine-url`` from a
forgotten one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

SUPERVISOR = "workers.generate.engines.supervisor"
ENGINE_MARKERS = ("sglang.launch_server",)


@dataclass(frozen=True)
class Leftover:
    """An engine tree nobody owns: its process group, its pids, and what it runs."""

    pgid: int
    pids: list[int]
    command: str
    source: str   # the pid file it was found through, or "process scan"

    @property
    def stop_command(self) -> str:
        # SIGCONT wakes a stopped supervisor, which then ends the tree itself.
        return f"kill -TERM -- -{self.pgid}; kill -CONT -- -{self.pgid}"


def _alive(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _group(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and _alive(proc):
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _command(procs: list[psutil.Process]) -> str:
    for proc in procs:
        try:
            return " ".join(proc.cmdline())[:200]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return "?"


def _lives(pid: int | None, create_time: float | None) -> bool:
    """``pid`` is alive, running (not stopped), and still the process recorded."""
    if pid is None:
        return False
    try:
        proc = psutil.Process(pid)
        same = create_time is None or abs(proc.create_time() - create_time) < 1.0
        return same and _alive(proc) and proc.status() != psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def from_pid_files(engines_dir: Path) -> list[Leftover]:
    """Process groups whose recorded owner (the worker) or supervisor is gone or stopped while
    members of the group live on."""
    found = []
    for path in sorted(engines_dir.glob("engine-*.pid")):
        try:
            record = json.loads(path.read_text())
            pgid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        owner = record.get("owner")
        if _lives(pgid, None) and (owner is None or _lives(owner,
                                                          record.get("owner_create_time"))):
            continue   # its supervisor runs, and ends the engine when its worker dies
        members = _group(pgid)
        if members:
            found.append(Leftover(pgid, sorted(p.pid for p in members), _command(members),
                                  str(path)))
    return found


def _supervised(proc: psutil.Process) -> bool:
    try:
        return any(SUPERVISOR in " ".join(p.cmdline()) for p in proc.parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True   # gone, or not ours to judge


def unsupervised_servers(known: set[int]) -> list[Leftover]:
    """SGLang servers with no supervisor above them (outside the groups already found)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if not any(marker in cmdline for marker in ENGINE_MARKERS) or SUPERVISOR in cmdline:
            continue
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            continue
        if pgid in known or not _alive(proc) or _supervised(proc):
            continue
        known.add(pgid)
        found.append(Leftover(pgid, sorted(p.pid for p in _group(pgid)), cmdline[:200],
                              "process scan"))
    return found


def leftover_engines(engines_dir: Path) -> list[Leftover]:
    """Every engine tree on this host that no live worker owns."""
    recorded = from_pid_files(engines_dir)
    return recorded + unsupervised_servers({left.pgid for left in recorded})

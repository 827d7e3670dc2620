"""Engine servers on this host that no live worker owns, for ``doctor``.

A generate worker starts its engine under a supervisor (a process-group leader) that kills the
engine's tree when the worker dies, and records the supervisor in a pid file
(``DFLASH_CACHE_DIR/engines/engine-PORT.pid``). An engine outlives its worker only when that
supervisor was killed first (``kill -9`` of the supervisor itself): then the pid file names a
dead supervisor whose process group still has live members. SGLang servers that run under no
supervisor at all (started by hand, or by a worker of an older release) are listed too, since a
worker cannot tell one it serves through ``--engine-url`` from a forgotten one.
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
        return f"kill -TERM -- -{self.pgid}"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
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


def from_pid_files(engines_dir: Path) -> list[Leftover]:
    """Process groups of recorded supervisors that died while their engine lives on."""
    found = []
    for path in sorted(engines_dir.glob("engine-*.pid")):
        try:
            pgid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if psutil.pid_exists(pgid) and _alive(psutil.Process(pgid)):
            continue   # its supervisor lives, and dies with its worker
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

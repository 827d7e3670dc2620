"""Clean-up a generate worker runs before it starts its engine: stale engines and shared memory.

A worker that crashed (kill -9, OOM, node reboot of the container) can leave its engine
running on the GPU and SGLang/torch segments in ``/dev/shm``. The next run of the same worker::

    from workers.preflight import DEFAULT_SHM_PREFIXES, EnginePidFile, kill_tree, worker_preflight
    pid_file = EnginePidFile(state_dir / "engine-gpu0.pid", marker="--port 30000")
    results = worker_preflight(gpu=0, pid_file=pid_file, require_driver=True)
    if not all(r.ok for r in results): ...            # refuse to start, print r.detail / r.fix
    proc = subprocess.Popen([...], start_new_session=True)  # own group: orphans stay findable
    pid_file.write(proc.pid)
    ...
    kill_tree(proc.pid); pid_file.clear()              # on shutdown

Tested by ``pytest tests/test_preflight.py``. The generic checks live in
:mod:`common.engine.preflight`.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from common.engine.preflight import CheckResult, check_gpu_clean
from common.errors import EngineError

log = logging.getLogger(__name__)

DEFAULT_SHM_PREFIXES = ("psm_", "sem.mp-", "torch_")
"""What SGLang (multiprocessing shared memory, named semaphores) and torch leave behind."""


def _alive(proc: psutil.Process) -> bool:
    # A zombie holds no GPU memory and dies with its parent's wait(); some container inits never
    # reap, so waiting for zombies to vanish would always time out.
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while True:
        alive = [p for p in alive if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _signal_all(procs: Iterable[psutil.Process], kill: bool) -> None:
    for proc in procs:
        try:
            proc.kill() if kill else proc.terminate()
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied as exc:
            raise EngineError(f"not allowed to signal pid {proc.pid}; stop it as its owner "
                              f"(`sudo kill {proc.pid}`)") from exc


def _descendants(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for proc in procs:
        found[proc.pid] = proc
        try:
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants now (empty when it is gone)."""
    try:
        return _descendants([psutil.Process(pid)])
    except psutil.NoSuchProcess:
        return []


def stop_processes(procs: list[psutil.Process], timeout: float = 10.0) -> list[int]:
    """SIGTERM those of ``procs`` still alive, SIGKILL survivors after ``timeout``."""
    return _stop([p for p in procs if _alive(p)], timeout)


def kill_tree(pid: int, timeout: float = 10.0) -> list[int]:
    """SIGTERM ``pid`` and its descendants, SIGKILL survivors after ``timeout``; pids signalled."""
    try:
        procs = _descendants([psutil.Process(pid)])
    except psutil.NoSuchProcess:
        return []
    return _stop(procs, timeout)


def _stop(procs: list[psutil.Process], timeout: float) -> list[int]:
    signalled = {p.pid for p in procs}
    _signal_all(procs, kill=False)
    alive = _wait_gone(procs, timeout)
    if alive:
        # Children forked while the tree was shutting down were not in the first snapshot.
        alive = [p for p in _descendants(alive) if _alive(p)]
        signalled.update(p.pid for p in alive)
        log.warning("pids %s ignored SIGTERM for %.0f s; sending SIGKILL",
                    [p.pid for p in alive], timeout)
        _signal_all(alive, kill=True)
        for proc in _wait_gone(alive, 5.0):
            log.error("pid %d survived SIGKILL (uninterruptible I/O?)", proc.pid)
    return sorted(signalled)


@dataclass(frozen=True)
class EngineRecord:
    pid: int
    create_time: float
    marker: str


class EnginePidFile:
    """The engine's pid, start time and a command-line marker, for stopping a leftover engine."""

    def __init__(self, path: str | os.PathLike[str], marker: str) -> None:
        if not marker.strip():
            raise ValueError("the marker must be a non-empty part of the engine's command line")
        self.path = Path(path)
        self.marker = marker

    def write(self, pid: int) -> None:
        """Record ``pid`` (atomically: a crash mid-write never leaves a half record)."""
        try:
            create_time = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess as exc:
            raise EngineError(f"engine pid {pid} exited before it could be recorded") from exc
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        me = psutil.Process()
        # The owner (this worker) too: doctor calls an engine whose owner is gone a leftover,
        # whatever state its supervisor is in (killed, or stopped with SIGSTOP).
        record = {"pid": pid, "create_time": create_time, "marker": self.marker,
                  "owner": me.pid, "owner_create_time": me.create_time()}
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def read(self) -> EngineRecord | None:
        """The recorded engine, or None when there is no (readable) record."""
        try:
            raw = json.loads(self.path.read_text())
            return EngineRecord(int(raw["pid"]), float(raw["create_time"]), str(raw["marker"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable engine pid file %s: %s", self.path, exc)
            return None

    def clear(self) -> None:
        """Forget the record (after a clean engine shutdown)."""
        self.path.unlink(missing_ok=True)

    def kill_stale(self, timeout: float = 10.0) -> int | None:
        """Stop the recorded engine's processes if any still run; its pid if so, else None."""
        record = self.read()
        if record is None:
            return None
        procs = _stale_engine(record)
        if procs:
            log.warning("stopping stale engine pid %d (%d process(es)) from an earlier run",
                        record.pid, len(procs))
            _stop(procs, timeout)
        self.clear()
        return record.pid if procs else None


def _own_lineage() -> set[int]:
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def _stale_engine(record: EngineRecord) -> list[psutil.Process]:
    """The recorded engine's processes, but only if the pid still names that same engine."""
    if record.pid in _own_lineage():
        return []
    try:
        root = psutil.Process(record.pid)
        if abs(root.create_time() - record.create_time) >= 1.0:
            log.info("pid %d now belongs to another process; leaving it", record.pid)
            return []
        if _alive(root):
            cmdline = " ".join(root.cmdline())
            if record.marker not in cmdline:
                log.info("pid %d no longer looks like the engine (%r); leaving it",
                         record.pid, cmdline[:200])
                return []
            # Descendants that double-forked away from the tree are still in its group.
            group = _group_members(record.pid, record.create_time - 1.0, exclude=os.getpgid(0))
            return _descendants([root, *group])
    except psutil.NoSuchProcess:
        pass
    except psutil.AccessDenied:
        log.warning("cannot inspect pid %d; leaving it alone", record.pid)
        return []
    # The engine itself is gone, but its workers may live on as orphans. Engines are started as
    # group leaders, and the kernel never hands out a pid that still names a process group, so
    # members of that group started after the engine are its descendants.
    return _group_members(record.pid, record.create_time - 1.0, exclude=os.getpgid(0))


def _group_members(pgid: int, since: float, exclude: int) -> list[psutil.Process]:
    if pgid == exclude:  # our own group: the engine was not started as a group leader
        return []
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.create_time() >= since and _alive(proc):
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _in_use(root: str) -> set[tuple[int, int]]:
    """(device, inode) of files under ``root`` that any visible process has mapped or open."""
    used: set[tuple[int, int]] = set()
    prefix = root.rstrip("/") + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    # address perms offset dev inode path: paths may carry " (deleted)".
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(prefix):
                        major, minor = (int(x, 16) for x in parts[3].split(":"))
                        used.add((os.makedev(major, minor), int(parts[4])))
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # the process exited, or belongs to a user we may not inspect
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    used.add((st.st_dev, st.st_ino))
            except OSError:  # closed meanwhile
                continue
    return used


def remove_owned_shm(prefixes: Sequence[str], root: str | os.PathLike[str] = "/dev/shm"
                     ) -> list[str]:
    """Delete this user's regular files in ``root`` named ``prefix*`` that nobody has open."""
    if not prefixes or not all(prefixes):
        raise ValueError("give non-empty name prefixes, e.g. DEFAULT_SHM_PREFIXES")
    real = os.path.realpath(root)
    try:
        entries = [e for e in os.scandir(real) if e.name.startswith(tuple(prefixes))]
    except FileNotFoundError:
        return []
    # Other workers of the same user on this host may be using theirs right now. Processes in
    # other PID namespaces sharing this /dev/shm (docker --ipc=host) are invisible here.
    used = _in_use(real) if entries else set()
    removed = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                continue
            if (st.st_dev, st.st_ino) in used:
                log.info("keeping %s: a live process has it open", entry.path)
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove %s: %s", entry.path, exc)
            continue
        removed.append(entry.path)
    if removed:
        log.warning("removed %d leftover shared-memory file(s): %s", len(removed), removed)
    return removed


def worker_preflight(gpu: int | None, pid_file: EnginePidFile | None,
                     shm_prefixes: Sequence[str] = DEFAULT_SHM_PREFIXES,
                     require_driver: bool = False, shm_root: str = "/dev/shm"
                     ) -> list[CheckResult]:
    """Stop a stale engine, drop leftover shared memory, then check that the GPU is free."""
    results = []
    if pid_file is not None:
        try:
            pid = pid_file.kill_stale()
            results.append(CheckResult("stale engine", ok=True, warn=pid is not None,
                                       detail=f"stopped stale engine pid {pid} and its children"
                                       if pid else "none recorded or running"))
        except EngineError as exc:
            results.append(CheckResult("stale engine", ok=False, detail=str(exc),
                                       fix=f"stop it by hand, then delete {pid_file.path}"))
    removed = remove_owned_shm(shm_prefixes, shm_root)
    results.append(CheckResult("shared memory", ok=True, warn=bool(removed),
                               detail=f"removed {', '.join(removed)}" if removed else
                               "no leftover segments"))
    if gpu is not None:
        results.append(check_gpu_clean(gpu, require_driver=require_driver))
    return results

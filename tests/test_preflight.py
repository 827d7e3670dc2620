"""Worker preflight on real processes and files: stale engine trees, shared memory, disk.

Run: ``pytest tests/test_preflight.py -q``; the NVML checks are in ``tests/test_nvml.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from common.engine.preflight import (
    check_disk,
)
from tests.conftest import wait_until
from workers.preflight import (
    DEFAULT_SHM_PREFIXES,
    EnginePidFile,
    kill_tree,
    remove_owned_shm,
    worker_preflight,
)

# A parent that spawns a child, both sleeping; argv[1] is the marker, argv[2] "ignore-term" makes
# both ignore SIGTERM so that only SIGKILL stops them.
TREE = """
import signal, subprocess, sys, time
CHILD = ("import signal, sys, time\\n"
         "if sys.argv[2] == 'ignore-term': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
         "time.sleep(300)")
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", CHILD, *sys.argv[1:]])
print(child.pid, flush=True)
time.sleep(300)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def spawn() -> Iterator:
    """Start process trees; whatever a test leaves running is killed afterwards."""
    procs: list[subprocess.Popen[str]] = []
    children: list[int] = []

    def start(marker: str, mode: str = "plain", **kw: object) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen([sys.executable, "-c", TREE, marker, mode],
                                stdout=subprocess.PIPE, text=True, **kw)
        procs.append(proc)
        child = int(proc.stdout.readline())
        children.append(child)
        return proc, child

    yield start
    for pid in children + [p.pid for p in procs]:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        proc.wait(timeout=10)


@pytest.mark.parametrize("mode", ["plain", "ignore-term"])
def test_kill_stale_stops_the_whole_tree(tmp_path: Path, spawn, mode: str) -> None:  # noqa: ANN001
    marker = f"fake-engine-{uuid.uuid4().hex[:8]}"
    parent, child = spawn(marker, mode)
    pid_file = EnginePidFile(tmp_path / "engine.pid", marker=marker)
    pid_file.write(parent.pid)
    assert pid_file.read().pid == parent.pid

    assert pid_file.kill_stale(timeout=1.0) == parent.pid
    parent.wait(timeout=10)
    wait_until(lambda: gone(child), 10, "the engine's child to exit")
    assert not pid_file.path.exists()
    assert pid_file.kill_stale() is None  # nothing recorded any more


def test_kill_stale_finds_orphans_of_a_dead_engine(tmp_path: Path, spawn) -> None:  # noqa: ANN001
    marker = f"fake-engine-{uuid.uuid4().hex[:8]}"
    parent, child = spawn(marker, start_new_session=True)
    pid_file = EnginePidFile(tmp_path / "engine.pid", marker=marker)
    pid_file.write(parent.pid)
    parent.kill()  # the engine dies, its worker lives on as an orphan in the engine's group
    parent.wait(timeout=10)
    assert not gone(child)

    assert pid_file.kill_stale(timeout=1.0) == parent.pid
    wait_until(lambda: gone(child), 10, "the orphaned child to exit")


DAEMONIZING = """
import os, time
if os.fork() == 0:
    if os.fork() == 0:  # the grandchild: reparented away from the tree, still in its group
        print(os.getpid(), flush=True)
        time.sleep(300)
    os._exit(0)
os.wait()
time.sleep(300)
"""


def test_kill_stale_finds_double_forked_descendants(tmp_path: Path) -> None:
    marker = f"fake-engine-{uuid.uuid4().hex[:8]}"
    engine = subprocess.Popen([sys.executable, "-c", DAEMONIZING, marker], text=True,
                              stdout=subprocess.PIPE, start_new_session=True)
    grandchild = int(engine.stdout.readline())
    try:
        assert grandchild not in [c.pid for c in psutil.Process(engine.pid).children(True)]
        pid_file = EnginePidFile(tmp_path / "engine.pid", marker=marker)
        pid_file.write(engine.pid)
        assert pid_file.kill_stale(timeout=2.0) == engine.pid
        engine.wait(timeout=10)
        wait_until(lambda: gone(grandchild), 10, "the double-forked grandchild to exit")
    finally:
        for pid in (engine.pid, grandchild):
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        engine.wait(timeout=10)


def test_kill_stale_spares_unrelated_processes(tmp_path: Path, spawn) -> None:  # noqa: ANN001
    pid_file = EnginePidFile(tmp_path / "engine.pid", marker="python")
    pid_file.write(os.getpid())  # the test process itself: never
    assert pid_file.kill_stale() is None

    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        pid_file = EnginePidFile(tmp_path / "engine.pid", marker="fake-engine-absent")
        pid_file.write(sleeper.pid)  # alive, but not the engine: no marker in its argv
        assert pid_file.kill_stale(timeout=0.5) is None
        assert not pid_file.path.exists()

        # Right marker, wrong start time: the pid was reused by another process.
        marker = f"fake-engine-{uuid.uuid4().hex[:8]}"
        parent, child = spawn(marker)
        pid_file = EnginePidFile(tmp_path / "engine.pid", marker=marker)
        pid_file.write(parent.pid)
        record = json.loads(pid_file.path.read_text())
        pid_file.path.write_text(json.dumps({**record, "create_time": record["create_time"] - 60}))
        assert pid_file.kill_stale(timeout=0.5) is None
        assert sleeper.poll() is None and parent.poll() is None and not gone(child)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_pid_file_edge_cases(tmp_path: Path) -> None:
    pid_file = EnginePidFile(tmp_path / "sub" / "engine.pid", marker="sglang")
    assert pid_file.read() is None and pid_file.kill_stale() is None
    pid_file.path.parent.mkdir()
    pid_file.path.write_text("not json")
    assert pid_file.read() is None
    with pytest.raises(ValueError):
        EnginePidFile(tmp_path / "x.pid", marker=" ")
    assert kill_tree(2**22 + 12345) == []  # above pid_max: never exists


def test_kill_tree_returns_every_pid(spawn) -> None:  # noqa: ANN001
    parent, child = spawn("fake-engine-tree")
    assert kill_tree(parent.pid, timeout=5) == sorted([parent.pid, child])
    parent.wait(timeout=10)
    wait_until(lambda: gone(child), 10, "the child to exit")


def test_remove_owned_shm_only_touches_matching_unused_own_files(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    for name in ("psm_dead", "sem.mp-dead", "torch_dead", "other_file", "psm_open",
                 "psm_mapped", "psm_foreign", "xpsm_1"):
        (root / name).write_bytes(b"\0" * 4096)
    (root / "psm_dir").mkdir()
    (tmp_path / "target").write_text("keep")
    (root / "psm_link").symlink_to(tmp_path / "target")
    if os.geteuid() == 0:
        os.chown(root / "psm_foreign", 65534, 65534)  # another user's segment
    else:
        (root / "psm_foreign").unlink()

    held = open(root / "psm_open", "rb")  # held open: it is in use
    mapper = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys, time\n"
         "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
         "print('ready', flush=True); time.sleep(300)", str(root / "psm_mapped")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert mapper.stdout.readline().strip() == "ready"
        removed = remove_owned_shm(list(DEFAULT_SHM_PREFIXES), root=root)
        assert sorted(Path(p).name for p in removed) == ["psm_dead", "sem.mp-dead", "torch_dead"]
        left = {p.name for p in root.iterdir()}
        assert {"other_file", "psm_open", "psm_mapped", "psm_dir", "psm_link", "xpsm_1"} <= left
        assert os.geteuid() != 0 or "psm_foreign" in left
        assert (tmp_path / "target").read_text() == "keep"
    finally:
        held.close()
        mapper.kill()
        mapper.wait()
    # Once nobody uses them any more they go too.
    removed = remove_owned_shm(["psm_"], root=root)
    assert sorted(Path(p).name for p in removed) == ["psm_mapped", "psm_open"]
    with pytest.raises(ValueError):
        remove_owned_shm(["psm_", ""], root=root)
    assert remove_owned_shm(["psm_"], root=tmp_path / "missing") == []


def test_worker_preflight_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    (tmp_path / "psm_left").write_bytes(b"x")
    pid_file = EnginePidFile(tmp_path / "engine.pid", marker="sglang")
    rows = worker_preflight(0, pid_file, require_driver=True, shm_root=str(tmp_path))
    assert [(r.name, r.status) for r in rows] == [
        ("stale engine", "PASS"), ("shared memory", "WARN"), ("gpu 0", "FAIL")]
    assert worker_preflight(None, None, shm_root=str(tmp_path))[0].status == "PASS"


def test_check_disk_thresholds(tmp_path: Path) -> None:
    # A directory that does not exist yet is measured on its nearest existing parent.
    assert "GiB free at" in check_disk("disk", tmp_path / "not" / "yet").detail
    assert check_disk("disk", tmp_path, warn_gib=1e9, fail_gib=0).status == "WARN"
    failed = check_disk("disk", tmp_path, warn_gib=1e9, fail_gib=1e9)
    assert failed.status == "FAIL" and "GiB free" in failed.detail and failed.fix

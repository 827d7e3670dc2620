"""Processes a worker starts die with it: a lifeline child, its parent killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tests.conftest import ROOT, wait_until
from workers.launch import visible_devices

CHILD = ("import time; from common.lifeline import die_with_parent; "
         "die_with_parent(poll_s=0.2); print('ready', flush=True); time.sleep(600)")
PARENT = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {CHILD!r}]);"
          " print(p.pid, flush=True); time.sleep(600)")


def test_a_lifeline_child_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    assert parent.stdout.readline().strip() == "ready"     # its lifeline holds from here
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()

    def gone() -> bool:
        try:
            return child.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, 15, "the child to stop with its parent")


def test_a_tensor_parallel_engine_gets_its_gpus() -> None:
    assert visible_devices(0, 1) == "0"
    assert visible_devices(2, 2) == "2,3"       # --gpu 2 --tp 2

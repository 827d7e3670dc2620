"""The engine ``bench --run`` starts, exactly as a generate worker does, for one configuration.

The launch line is the worker's own (:func:`common.engine.serving.engine_command`:
``--engine-cmd`` with its fields, or ``python -m sglang.launch_server`` with the MTP flags of
:mod:`common.engine.mtp`, the engine args and the running-request cap), on the GPUs
``--gpu``/``--tp`` name (``CUDA_VISIBLE_DEVICES``), under the worker's supervisor, so the engine's
whole tree ends with the bench however the bench ends. It listens on a free port (a worker's engine
may hold the usual one) and logs to ``DFLASH_CACHE_DIR/engines/bench-PORT.log``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.engine.leftovers import SUPERVISOR
from common.engine.serving import shown_argv
from common.errors import EngineError

log = logging.getLogger(__name__)

DRAIN_S = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no engine log)"


@contextmanager
def launched(argv: list[str], url: str, log_dir: Path, startup_timeout: float,
             gpus: str | None = None) -> Iterator[str]:
    """Start ``argv`` under the supervisor, wait for ``/health``; yields the URL, then stops the
    engine's tree (a drain of :data:`DRAIN_S`, then a kill)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"bench-{url.rsplit(':', 1)[-1]}.log"
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {}))
    log.info("bench: starting engine: %s (log %s)", shown_argv(argv), log_path)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", SUPERVISOR, "--drain", str(DRAIN_S), "--",
                                 *argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + startup_timeout
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise EngineError(f"the engine did not become healthy at {url} within "
                                  f"{startup_timeout:.0f}s; last log lines ({log_path}):\n"
                                  f"{_tail(log_path)}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the supervisor (it drains, then ends the tree); past that, kill the group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=DRAIN_S + 15)
            return
        except subprocess.TimeoutExpired:
            log.warning("bench: engine pid %d did not stop: killing its group", proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

"""The engine server a generate worker owns: launch, wait for health, restart, drain, stop.

The worker starts its SGLang server (``python -m sglang.launch_server ...``, or the command in
``DFLASH_ENGINE_CMD``) under a small supervisor (:mod:`workers.generate.engines.supervisor`)
that kills the engine's whole tree when the worker dies, however it dies. It waits for
``/health``, restarts the engine with capped backoff if it dies (requests in flight are retried
by the client meanwhile), and on shutdown lets it drain (SIGTERM, ``DFLASH_ENGINE_DRAIN_TIMEOUT``)
before its tree is killed. A pid file lets the next start of the same worker, and ``doctor``,
find an engine that outlived its supervisor.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from common.config import Settings
from common.engine.serving import engine_command, shown_argv
from common.errors import EngineError
from workers.generate.engines.supervisor import SUPERVISOR_MODULE
from workers.preflight import (
    EnginePidFile,
    kill_tree,
    process_tree,
    stop_processes,
    worker_preflight,
)

log = logging.getLogger(__name__)

_RESTART_BACKOFF_MAX_S = 60.0


def server_command(settings: Settings, model_path: Path,
                   mtp_args: Sequence[str] = ()) -> list[str]:
    """The launch command (:func:`common.engine.serving.engine_command`, shared with
    ``bench --run``); ``{port}``, ``{model}``, ``{gpu}``, ``{tp}`` and ``{engine_args}`` are filled
    in."""
    return engine_command(settings, model_path, mtp_args)


# SGLang's /health runs a one-token generation: 1 s or more, up to 20 s on a busy engine.
HEALTH_TIMEOUT_S = 30.0


def healthy(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class EngineServer:
    """One engine process (tree) per worker, kept alive until :meth:`stop`."""

    def __init__(self, argv: list[str], url: str, run_dir: Path, startup_timeout: float,
                 drain_timeout: float = 30.0) -> None:
        self.argv, self.url, self.startup_timeout = argv, url, startup_timeout
        self.drain_timeout = drain_timeout
        run_dir.mkdir(parents=True, exist_ok=True)
        port = url.rsplit(":", 1)[-1]
        self.log_path = run_dir / f"engine-{port}.log"
        self.pid_file = EnginePidFile(run_dir / f"engine-{port}.pid", marker=port)
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Clean up after an earlier crash, launch, wait for health, then watch the process."""
        self.preflight()
        self._launch()
        self._watcher = threading.Thread(target=self._watch, name="engine-watch", daemon=True)
        self._watcher.start()

    def preflight(self) -> None:
        """Stop a stale engine and drop leftover shared memory (``doctor`` checks the GPU)."""
        for result in worker_preflight(None, self.pid_file):
            if not result.ok:
                raise EngineError(f"{result.name}: {result.detail} (fix: {result.fix})")
            if result.warn:
                log.warning("preflight %s: %s", result.name, result.detail)

    def _launch(self) -> None:
        log.info("starting engine: %s (log %s)", shown_argv(self.argv), self.log_path)
        supervised = [sys.executable, "-m", SUPERVISOR_MODULE, "--drain",
                      str(self.drain_timeout), "--", *self.argv]
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(supervised, stdout=log_file, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pid_file.write(self.proc.pid)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if healthy(self.url):
                log.info("engine healthy at %s (pid %d)", self.url, self.proc.pid)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self._kill()
        raise EngineError(f"engine did not become healthy at {self.url} within "
                          f"{self.startup_timeout:.0f}s; last log lines:\n{self.log_tail()}")

    def _watch(self) -> None:
        backoff = 1.0
        while not self._stopping.wait(1.0):
            if self.proc is None or self.proc.poll() is None:
                continue
            log.error("engine pid %d exited with %s; restarting in %.0fs (log %s)",
                      self.proc.pid, self.proc.returncode, backoff, self.log_path)
            if self._stopping.wait(backoff):
                return
            try:
                self._launch()
                self.restarts += 1
                backoff = 1.0
            except EngineError as exc:
                log.error("engine restart failed: %s", exc)
                backoff = min(_RESTART_BACKOFF_MAX_S, backoff * 2)

    def _kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc.wait()

    def _drain(self) -> None:
        """SIGTERM the supervisor (the engine finishes what it runs, then its tree is ended);
        past the drain and a grace, the tree is killed from here."""
        if self.proc is None or self.proc.poll() is not None:
            self._kill()
            return
        tree = process_tree(self.proc.pid)
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=self.drain_timeout + 15)
        except subprocess.TimeoutExpired:
            log.warning("engine pid %d still draining after %.0fs: killing its tree",
                        self.proc.pid, self.drain_timeout)
        except ProcessLookupError:
            pass
        stop_processes(tree, timeout=10.0)   # whatever of the tree outlived the drain

    def stop(self) -> None:
        """Stop watching, let the engine drain, then end its whole process tree."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self._drain()
        self.pid_file.clear()
        log.info("engine at %s stopped", self.url)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no engine log)"

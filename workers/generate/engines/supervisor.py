"""Ties an engine's life to its worker's: ``python -m workers.generate.engines.supervisor
[--drain S] -- ENGINE ARGV...``.

The generate worker starts this small process (in a session of its own) instead of the engine
itself. It starts the engine as its child and makes itself a child subreaper, so every process
of the engine tree (SGLang's scheduler and detokenizer, whatever they fork) stays beneath it even
when its parent dies first. Then it watches, twice a second:

- its worker is gone (the parent pid changed: ``kill -9``, the OOM killer, a crash): the whole
  tree is killed at once and it exits; nobody is left to read the answers, so nothing drains;
- SIGTERM or SIGINT (the worker's clean stop): SIGTERM to the engine, which finishes the
  requests it runs, for up to ``--drain`` seconds; then what is left of the tree is killed;
- the engine exited: what is left of its tree is killed and it exits with the engine's code,
  and the worker restarts it.

Only a ``kill -9`` of this process itself leaves an engine behind; ``doctor`` lists such
leftovers with the command that stops them, and the worker's next start stops its own.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time

log = logging.getLogger("workers.generate.engines.supervisor")

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.5
SUPERVISOR_MODULE = "workers.generate.engines.supervisor"


def become_subreaper() -> None:
    """Orphans of the engine tree are reparented here, not to init (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.warning("not a child subreaper (%r): the engine's orphans may outlive it", exc)


def reap() -> dict[int, int]:
    """Collect every exited child (orphans included); returns {pid: exit code}."""
    done: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = os.waitstatus_to_exitcode(status)


def stop_tree(engine: int | None, drain: float) -> None:
    """SIGTERM the engine and give it ``drain`` seconds, then end every descendant left."""
    from workers.preflight import process_tree, stop_processes

    if engine is not None and drain > 0:
        try:
            os.kill(engine, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + drain
        while time.monotonic() < deadline and engine not in reap():
            time.sleep(0.1)
    stop_processes(process_tree(os.getpid())[1:], timeout=5.0)
    reap()


def supervise(argv: list[str], drain: float) -> int:
    """Run the engine until it exits, the worker is gone, or a stop signal; its exit code."""
    parent = os.getppid()
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: stopping.append(number))
    become_subreaper()
    engine = os.posix_spawnp(argv[0], argv, dict(os.environ))
    log.info("engine pid %d started under supervisor %d (worker %d)", engine, os.getpid(),
             parent)
    while True:
        exited = reap()
        if engine in exited:
            log.warning("engine pid %d exited with %d", engine, exited[engine])
            stop_tree(None, 0)
            return exited[engine] or 1
        if stopping:
            log.info("stop requested: engine pid %d drains for up to %.0fs", engine, drain)
            stop_tree(engine, drain)
            return 0
        if os.getppid() != parent:
            log.warning("worker %d is gone: stopping engine pid %d and its tree", parent, engine)
            stop_tree(None, 0)
            return 1
        time.sleep(POLL_S)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {SUPERVISOR_MODULE}",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--drain", type=float, default=30.0,
                        help="seconds a stopping engine may finish its requests")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the engine command")
    parsed = parser.parse_args(args)
    argv = parsed.argv[1:] if parsed.argv[:1] == ["--"] else parsed.argv
    if not argv:
        parser.error("give the engine command after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    sys.exit(supervise(argv, parsed.drain))


if __name__ == "__main__":
    main()

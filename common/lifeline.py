"""A process that must not outlive the one that started it: a watchdog thread polls the parent
pid and ends this process when it changes (the parent died, however: ``kill -9``, OOM).

Polling, not ``PR_SET_PDEATHSIG``: that signal follows the *thread* that forked, and launchers
(torch's, Celery's) may start children from threads that end before the child should.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)


def die_with_parent(poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """From now on, SIGTERM this process when its parent is gone; SIGKILL ``grace_s`` later."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.error("parent pid %d is gone: stopping pid %d", parent, os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()

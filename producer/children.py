"""Child processes the demo starts die with it (its workers, Redis and commands)."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """A child's preexec_fn: SIGTERM it when the demo dies, even by SIGKILL (Linux), so that
    no worker or Redis the demo started outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the demo's own cleanup still stops them
        pass

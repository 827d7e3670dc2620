"""Test-only fault injection: make a named point raise, to prove that the skeleton parks it.

``DFLASH_TEST_FAULT="hidden.forward=CUDA out of memory"`` makes :func:`inject` raise
``RuntimeError("CUDA out of memory")`` at that point; ``export.file=sleep:0.5`` makes it wait
half a second instead, so that a test can kill a process mid-way, and ``generate.hand_off=kill``
makes the process ``kill -9`` itself there, and ``train.backward.rank0=oom@5`` raises
``torch.OutOfMemoryError("CUDA out of memory (injected)")`` the 5th time this process reaches
that point, and only then (several ``point=message`` pairs may be given, separated by ``;``).
Unset in every real deployment: then :func:`inject` costs one dict lookup.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from functools import cache

from common.choices import FaultAction

ENV = "DFLASH_TEST_FAULT"
OOM_AT = re.compile(r"oom@([1-9][0-9]*)")
_reached: Counter[str] = Counter()   # times each point was reached (the oom@N faults count)


@cache
def _faults() -> dict[str, str]:
    pairs = (item.partition("=") for item in os.environ.get(ENV, "").split(";") if item.strip())
    return {point.strip(): message.strip() or "injected fault" for point, _, message in pairs}


def inject(point: str) -> None:
    """Raise the configured error at ``point``, if one is configured for it."""
    message = _faults().get(point)
    if message is None:
        return
    if message == FaultAction.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    if message.startswith("sleep:"):
        time.sleep(float(message.removeprefix("sleep:")))
        return
    if oom := OOM_AT.fullmatch(message):
        _reached[point] += 1
        if _reached[point] == int(oom.group(1)):
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return
    raise RuntimeError(message)

"""The real SGLang for the tests: the pinned release from ``.venv-sglang``, serving a tiny dense
target on the CPU, started through the product's own launcher (``server_command`` and
:class:`EngineServer`, exactly as ``worker generate --engine sglang --engine-python ...`` does).

``bash scripts/setup.sh --sglang`` builds the venv (scripts/test.sh and so CI always do); without
it the real-engine tests skip with one line naming that command, except under CI, where they
fail: CI never skips them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from common.config import Settings, load_settings
from tests.conftest import MAX_STRETCH, ROOT

SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
# SGLang on the CPU (docs/guides/gpu-hosts.md): float32 (greedy output drifts from HF's
# otherwise), a bounded KV pool (70% of RAM otherwise), and a scheduler that sleeps when idle
# (it spins a core otherwise). SGLANG_USE_CPU_ENGINE stays unset: it needs a CPU sgl_kernel no
# registry has.
CPU_ENGINE_ARGS = "--device cpu --dtype float32 --max-total-tokens 16384 --sleep-on-idle"
# A short context, so that a second turn can outgrow it with rows of a few hundred tokens.
CONTEXT = 512
# Minutes on a busy machine: the scheduler imports torch and SGLang, then warms up.
STARTUP_S = 600 * MAX_STRETCH


def require_sglang() -> Path:
    """The venv's python, or skip (fail under CI) with the set-up command."""
    if SGLANG_PYTHON.exists():
        return SGLANG_PYTHON
    message = "no .venv-sglang: run `bash scripts/setup.sh --sglang` (the real-engine tests)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def sglang_settings(cache_dir: Path, port: int, *extra_args: str, **overrides: object
                    ) -> Settings:
    """What a generate worker with ``--engine sglang --engine-python .venv-sglang/...`` reads."""
    engine_args = " ".join((CPU_ENGINE_ARGS, f"--context-length {CONTEXT}", *extra_args))
    return load_settings({}, engine="sglang", engine_python=str(require_sglang()),
                         engine_args=engine_args, engine_port=port, gpu=0,
                         cache_dir=cache_dir, **overrides)


def engine_env(port: int, *extra_args: str) -> dict[str, str]:
    """The same settings as a worker's environment."""
    return {"DFLASH_ENGINE": "sglang", "DFLASH_ENGINE_PYTHON": str(require_sglang()),
            "DFLASH_ENGINE_ARGS": " ".join((CPU_ENGINE_ARGS, f"--context-length {CONTEXT}",
                                            *extra_args)),
            "DFLASH_ENGINE_PORT": str(port), "DFLASH_ENGINE_STARTUP_TIMEOUT": str(STARTUP_S),
            "OMP_NUM_THREADS": "1"}


@contextmanager
def real_server(model: Path, run_dir: Path, port: int, *extra_args: str,
                drain: float = 10.0) -> Iterator[str]:
    """A real SGLang server on ``model`` through the product's launcher; yields its URL."""
    from workers.generate.engines.server import EngineServer, server_command

    settings = sglang_settings(run_dir, port, *extra_args)
    url = f"http://127.0.0.1:{settings.engine_server_port}"
    server = EngineServer(server_command(settings, model), url, run_dir / "engines", STARTUP_S,
                          drain_timeout=drain)
    server.start()
    try:
        yield url
    finally:
        server.stop()

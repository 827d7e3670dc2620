"""The engines pipeline_vs_direct.py drives, side by side with its clients: the simulator
pinned to a core of its own, or the real SGLang on the CPU through the product's launcher."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import load_settings

ROOT = Path(__file__).resolve().parent.parent


def sglang_gauges(url: str) -> tuple[int, int]:
    """(running requests, prompt tokens so far) from a real SGLang's ``/metrics``: the prompt
    tokens move with the first prefill, so they date a client's first request."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("sglang:num_running_reqs", "sglang:prompt_tokens_total"):
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return (int(values.get("sglang:num_running_reqs", 0)),
            int(values.get("sglang:prompt_tokens_total", 0)))


def pin(cpus: set[int]) -> Callable[[], None] | None:
    """A preexec_fn keeping a child on ``cpus``: the simulator's busy loop gets its own core,
    so the clients' CPU time is not inflated by whatever shares theirs (less noise)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, cpus)


ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
ENGINE_CPUS = set(ALL_CPUS[:1]) if len(ALL_CPUS) >= 2 else set()
CLIENT_CPUS = set(ALL_CPUS[1:]) if len(ALL_CPUS) >= 2 else set()


def stop_engine(engine: Any) -> None:
    if isinstance(engine, subprocess.Popen):
        engine.terminate()
        engine.wait(timeout=30)
    else:
        engine.stop()


def start_engine(args: argparse.Namespace, model: Path, port: int, work: Path) -> Any:
    """The simulator process, or a real SGLang server through the product's launcher."""
    if args.engine == "sim":
        return subprocess.Popen([sys.executable, "-m", "embedded.simulator", "--port",
                                 str(port), "--max-running", str(args.cap), "--model-path",
                                 str(model), "--len-mu", "5.0", "--len-sigma", "0.8"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=pin(ENGINE_CPUS))
    from workers.generate.engines.server import EngineServer, server_command

    python = ROOT / ".venv-sglang" / "bin" / "python"
    if not python.exists():
        sys.exit("no .venv-sglang: run `bash scripts/setup.sh --sglang` first")
    settings = load_settings({}, engine="sglang", engine_python=str(python), engine_port=port,
                             engine_args=f"{CPU_ENGINE_ARGS} --max-running-requests {args.cap}")
    server = EngineServer(server_command(settings, model), f"http://127.0.0.1:{port}",
                          work / "engines", 900)
    server.start()
    print(f"real SGLang on the CPU at port {port} (log {server.log_path})", flush=True)
    return server


CPU_ENGINE_ARGS = "--device cpu --dtype float32 --max-total-tokens 16384 --sleep-on-idle"

"""``dflash-pipeline demo``: the whole generate stage on one machine, nothing to configure.

Starts a throwaway ``redis-server`` (AOF on) on a free port, one CPU generate worker, Flower and
the run dashboard (``dflash-pipeline ui``, same user and password as Flower), enqueues the 80
MT-Bench questions, shows live progress until every shard is committed, then stops what it
started. Storage is a local directory under ``--out``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import click
import redis

from common.config import load_settings
from common.errors import ConfigError
from common.records import RunState

STARTUP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    """A local Redis configured like production: AOF everysec, no eviction."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("redis-server not found; install it (apt-get install -y redis-server)")
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
         "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
         "--maxmemory-policy", "noeviction", "--logfile", str(data_dir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    raise ConfigError(f"redis-server did not start; see {data_dir / 'redis.log'}")


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM (a worker's soft shutdown flushes its part), then SIGKILL after ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)


def _alive(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    if proc.poll() is not None:
        raise ConfigError(f"the worker exited with code {proc.returncode}; see {log_path}")


def run_demo(input_path: str, out: str, run: str, shard_size: int, max_new_tokens: int,
             flower: bool, flower_port: int, ui: bool = True, ui_port: int = 8700,
             model: str | None = None) -> int:
    """Returns the process exit code: 0 when every shard committed."""
    from producer.commands import (
        build_run_config,
        context_check,
        print_enqueue_report,
        render_status,
        watch_progress,
    )
    from producer.enqueue import enqueue_run
    from producer.status import StatusReader

    out_dir = Path(out).resolve()
    with ExitStack() as stack:
        port = free_port()
        redis_proc = start_redis(out_dir / "redis", port)
        stack.callback(_stop, redis_proc)
        url = f"redis://127.0.0.1:{port}/0"
        settings = load_settings(broker_url=url, storage=str(out_dir / "storage"), model=model)
        env = dict(os.environ, DFLASH_BROKER_URL=url, DFLASH_STORAGE=settings.storage,
                   DFLASH_CACHE_DIR=str(settings.cache_dir), DFLASH_MODEL=settings.model)
        config = build_run_config(settings, run=run, input_path=input_path, fmt="auto",
                                  prompt_field=None, shard_size=shard_size, limit=None,
                                  max_new_tokens=max_new_tokens, temperature=0.7, top_p=0.95,
                                  top_k=50, thinking=True)
        exe = [sys.executable, "-m", "producer.cli"]
        worker = _spawn([*exe, "worker", "generate"], env, out_dir / "logs" / "worker.log")
        stack.callback(_stop, worker)
        password = secrets.token_urlsafe(9)
        if flower:
            proc = _spawn([sys.executable, "-m", "celery", "-A", "common.celery_app", "flower",
                           f"--port={flower_port}", "--address=127.0.0.1",
                           f"--basic-auth=dflash:{password}"], env, out_dir / "logs" / "flower.log")
            stack.callback(_stop, proc)
            click.echo(f"Flower: http://127.0.0.1:{flower_port}  (user dflash, password "
                       f"{password})")
        if ui:
            proc = _spawn([*exe, "ui", "--port", str(ui_port)],
                          {**env, "DFLASH_UI_AUTH": f"dflash:{password}"},
                          out_dir / "logs" / "ui.log")
            stack.callback(_stop, proc)
            click.echo(f"Dashboard: http://127.0.0.1:{ui_port}/runs/{run}  (user dflash, "
                       f"password {password})")
        from common.celery_app import make_app
        from common.storage import open_storage

        storage, client = open_storage(settings.storage), redis.Redis.from_url(
            url, decode_responses=True)
        started = time.monotonic()
        report = enqueue_run(storage, make_app(settings), client, config,
                             context_check(settings, config))
        print_enqueue_report(report, storage, as_json=False)
        click.echo(f"worker log: {out_dir / 'logs' / 'worker.log'}")
        status = watch_progress(StatusReader(storage, client, run), interval=1.0,
                                check=lambda: _alive(worker, out_dir / "logs" / "worker.log"))
        wall = time.monotonic() - started
    done, gates = status["samples"]["done"], status["gates"]
    click.echo(f"\n{done} samples committed {wall:.0f}s after enqueue "
               f"({done / wall:.2f} samples/s, {status['tokens']['generated']} tokens)")
    reasons = "".join(f", {r} {n}" for r, n in gates["reasons"].items())
    click.echo(f"quality gates: {gates['rejected']}/{gates['checked']} rejected "
               f"({gates['rate']:.1%}){reasons}")
    if status["state"] == RunState.PAUSED:
        click.echo(render_status(status))
    click.echo(f"results: {settings.storage}/runs/{run}/generated/  "
               f"(shard-*/part-*.jsonl.zst, listed by shard-*/_COMMIT.json)")
    click.echo(f"status:  DFLASH_STORAGE={settings.storage} dflash-pipeline status --run {run}")
    click.echo(f"report:  DFLASH_STORAGE={settings.storage} dflash-pipeline report --run {run}")
    click.echo(f"dashboard: DFLASH_STORAGE={settings.storage} dflash-pipeline ui  (then "
               f"http://127.0.0.1:8700/runs/{run})")
    return 0 if status["state"] == RunState.DONE else 1

"""``dflash-pipeline demo``: the whole product on one machine, nothing to configure.

Starts a throwaway ``redis-server`` (AOF on) on a free port, one CPU generate worker, a train
worker beside it, Flower and the run dashboard (``dflash-pipeline ui``, same user and password
as Flower), and enqueues the 80 MT-Bench questions as an online run with a held-out split: the
drafter trains on each shard as soon as it is committed while the rest is still generated, and
its real acceptance length is measured on held-out prompts while training and at the end
(:mod:`producer.demo_train`). Then it exports the dataset (Parquet) and the drafter, prints tau,
the lossless count and the paths, and stops what it started. ``--quick`` runs generation alone
(an offline run, no trainer). Storage is a local directory under ``--out``.
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
from dataclasses import dataclass
from pathlib import Path

import click
import redis

from common.choices import Mode, RunState
from common.config import load_settings
from common.errors import ConfigError
from common.exit_codes import EXIT_FAILURE, EXIT_OK
from common.runs.options import RunOptions
from producer.children import die_with_parent
from producer.status_record import RunStatus

STARTUP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
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
        return subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)


def _alive(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    if proc.poll() is not None:
        raise ConfigError(f"the worker exited with code {proc.returncode}; see {log_path}")


@dataclass(frozen=True)
class DemoOptions:
    """What ``dflash-pipeline demo`` was asked for."""

    input_path: str
    out: str
    run: str
    shard_size: int
    max_new_tokens: int
    flower: bool
    flower_port: int
    ui: bool = True
    ui_port: int = 8700
    quick: bool = False
    model: str | None = None
    eval_prompts: int = 16
    eval_max_new_tokens: int = 128
    epochs: int = 3


def run_demo(options: DemoOptions) -> int:
    """Returns the process exit code: 0 when every shard committed (and, unless ``quick``, was
    trained on, measured losslessly and exported)."""
    from producer.commands import (
        build_run_config,
        context_check,
        print_enqueue_report,
        render_status,
    )
    from producer.demo_train import (
        THREAD_ENV,
        TRAIN,
        finish_training,
        tau_by_epoch_line,
        watch_demo,
    )
    from producer.enqueue import enqueue_run
    from producer.status import StatusReader

    if hasattr(sys.stdout, "reconfigure"):  # piped into tee or a file: each line as it comes
        sys.stdout.reconfigure(line_buffering=True)
    out_dir = Path(options.out).resolve()
    run, logs = options.run, out_dir / "logs"
    with ExitStack() as stack:
        port = free_port()
        redis_proc = start_redis(out_dir / "redis", port)
        stack.callback(_stop, redis_proc)
        url = f"redis://127.0.0.1:{port}/0"
        settings = load_settings(broker_url=url, storage=str(out_dir / "storage"),
                                 model=options.model)
        env = dict(os.environ, DFLASH_BROKER_URL=url, DFLASH_STORAGE=settings.broker.storage,
                   DFLASH_CACHE_DIR=str(settings.target.cache_dir),
                   DFLASH_MODEL=settings.target.model)
        online = not options.quick
        config = build_run_config(settings, RunOptions(
            run=run, input=(options.input_path,), shard_size=options.shard_size,
            max_new_tokens=options.max_new_tokens, temperature=0.7, top_p=0.95, top_k=50,
            mode=Mode.ONLINE if online else Mode.OFFLINE, epochs=options.epochs))
        exe = [sys.executable, "-m", "producer.cli"]
        worker_env = {**THREAD_ENV, **env} if online else env
        workers = {"worker": _spawn([*exe, "worker", "generate"], worker_env,
                                    logs / "worker.log")}
        stack.callback(_stop, workers["worker"])
        if online:
            workers["trainer"] = _spawn([*exe, "worker", "train"], TRAIN.worker_env(env),
                                        logs / "trainer.log")
            stack.callback(_stop, workers["trainer"])
        password = secrets.token_urlsafe(9)
        if options.flower:
            proc = _spawn([sys.executable, "-m", "celery", "-A", "common.queue.celery_app",
                           "flower",
                           f"--port={options.flower_port}", "--address=127.0.0.1",
                           f"--basic-auth=dflash:{password}"], env, logs / "flower.log")
            stack.callback(_stop, proc)
            click.echo(f"Flower: http://127.0.0.1:{options.flower_port}  (user dflash, password "
                       f"{password})")
        if options.ui:
            proc = _spawn([*exe, "ui", "--port", str(options.ui_port)],
                          {**env, "DFLASH_UI_AUTH": f"dflash:{password}"}, logs / "ui.log")
            stack.callback(_stop, proc)
            click.echo(f"Dashboard: http://127.0.0.1:{options.ui_port}/runs/{run}  (user "
                       f"dflash, password {password})")
        from common.queue.celery_app import make_app
        from common.storage import open_storage

        storage = open_storage(settings.broker.storage, settings.read)
        client = redis.Redis.from_url(url, decode_responses=True)
        started = time.monotonic()
        report = enqueue_run(storage, make_app(settings), client, config,
                             context_check(settings, config))
        print_enqueue_report(report, storage, as_json=False)
        click.echo("logs: " + ", ".join(str(logs / f"{name}.log") for name in workers))

        def check() -> None:
            for name, proc in workers.items():
                _alive(proc, logs / f"{name}.log")

        watched = watch_demo(StatusReader(storage, client, run), online, check, started)
        status = watched.status
        click.echo(generation_summary(status, watched.generated_s))
        if online and status["downstream"].get("finished"):
            click.echo(tau_by_epoch_line(status["downstream"]))
        if status["state"] == RunState.PAUSED:
            click.echo(render_status(status))
        if status["state"] != RunState.DONE:
            return EXIT_FAILURE
        code = (finish_training(exe, env, out_dir, run, options.eval_prompts,
                                 options.eval_max_new_tokens) if online else EXIT_OK)
    click.echo(f"results: {settings.broker.storage}/runs/{run}/generated/  "
               f"(shard-*/part-*.jsonl.zst, listed by shard-*/_COMMIT.json)")
    root = settings.broker.storage
    click.echo(f"status:  DFLASH_STORAGE={root} dflash-pipeline status --run {run}")
    click.echo(f"report:  DFLASH_STORAGE={root} dflash-pipeline report --run {run}")
    click.echo(f"dashboard: DFLASH_STORAGE={root} dflash-pipeline ui  (then "
               f"http://127.0.0.1:8700/runs/{run})")
    click.echo(f"demo finished in {time.monotonic() - started:.0f}s after enqueue")
    return code


def generation_summary(status: RunStatus, wall: float) -> str:
    """Samples, rate and the quality gates' verdict, as the demo prints them."""
    done, gates = status["samples"]["done"], status["gates"]
    reasons = "".join(f", {r} {n}" for r, n in gates["reasons"].items())
    return (f"\n{done} samples committed {wall:.0f}s after enqueue ({done / wall:.2f} samples/s, "
            f"{status['tokens']['generated']} tokens)\nquality gates: {gates['rejected']}/"
            f"{gates['checked']} rejected ({gates['rate']:.1%}){reasons}")

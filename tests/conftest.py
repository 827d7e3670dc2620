"""Real components for the tests: redis-server processes, moto's S3 server, Celery workers.

Nothing here fakes our own code: workers are real ``dflash-pipeline worker generate`` processes
driving the tiny CPU model, Redis is a real ``redis-server`` on a free port, and S3 is moto's
server mode on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from producer.demo import free_port
from tests.models_cache import (  # noqa: F401 (re-exported)
    CACHE_DIR,
    HYBRID,
    MT_BENCH,
    ROOT,
    TARGETS,
    build_models,
)

# One intra-op thread for torch here and in every process a test starts (workers inherit the
# environment): the tiny models' ops are small, and with two threads per process on 2 shared
# cores the OpenMP spin-waits made a model step 5-10x slower (docs/reference/tests.md). Set
# before torch is first imported (nothing above imports it); an explicit setting from the
# caller wins.
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

# A deadline is for a hang, not a speed limit: on cores that other processes keep busy it
# stretches by the run queue's length per core (1x on an idle machine, at most MAX_STRETCH x).
MAX_STRETCH = 4.0


def load_stretch() -> float:
    """How much slower than idle the machine runs now: 1-minute load average per core."""
    return min(MAX_STRETCH, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               interval: float = 0.2) -> object:
    """Poll until ``predicate`` returns something truthy; fail the test at the deadline."""
    started = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        waited = time.monotonic() - started
        if waited >= timeout * load_stretch():
            raise AssertionError(f"timed out after {waited:.0f}s waiting for {what}")
        time.sleep(interval)


def call_json(url: str, body: object = None, timeout: float = 300) -> tuple[int, object]:
    """GET (no body) or POST JSON (or bytes) to ``url``: (status, parsed JSON, text, or None
    for an empty body), an HTTP error's status included."""
    import json as json_
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) or body is None else json_.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    if not raw.strip():
        return status, None
    try:
        return status, json_.loads(raw)
    except ValueError:
        return status, raw.decode()


@contextmanager
def running_simulator(*args: str) -> Iterator[str]:
    """The SGLang-protocol simulator as a real subprocess; yields its URL once healthy."""
    from workers.generate.engines.server import healthy

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "embedded.simulator", "--port", str(port), *args],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url, timeout=1), 30, "the simulator to be healthy")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@dataclass
class RedisServer:
    """A real redis-server with AOF on, restartable on the same port and data directory."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (apt-get install -y redis-server)"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # appendfsync always: a kill -9 in a test must not lose the last second of the queue.
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(up, 20, "redis-server to accept connections")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self):  # noqa: ANN201
        import redis

        return redis.Redis(port=self.port, decode_responses=True)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on loopback, shared by the session (each test uses its own bucket)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


AWS_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_storage(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; returns its storage URL with a prefix."""
    import boto3

    for key, value in {**AWS_ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/data"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """End-to-end tests first (grouped ones before them), so that the last minutes of an xdist
    run share out short tests instead of waiting on one long case started late."""
    def weight(item: pytest.Item) -> int:
        if item.get_closest_marker("xdist_group"):
            return 0
        return 1 if item.get_closest_marker("e2e") else 2

    items.sort(key=weight)   # stable: file order within each weight


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's set-up, call and teardown time, summed by file (on the xdist controller)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The suite's cost by file, dearest first: where the minutes go (before pytest's summary
    line, which stays last)."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("-", f"wall time by file ({total / 60:.1f} test-minutes in all)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the models before the first test that needs them, so that a build (minutes on a
    fresh clone, longer on busy cores) is not timed as part of that test (pytest-timeout counts
    a fixture's setup in the first test that uses it)."""
    if session.config.option.collectonly:
        return
    if any("model_cache" in getattr(item, "fixturenames", ()) for item in session.items):
        spent = build_models()
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if spent and reporter:
            reporter.write_line(f"tests/conftest.py: built the tiny models in {CACHE_DIR} "
                                f"in {spent:.0f} s")


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """The cache directory holding both tiny CPU targets (built once per build fingerprint)."""
    build_models()   # already done before the first test; a no-op then
    return CACHE_DIR


@dataclass(frozen=True)
class TinyTarget:
    """An embedded target as a test uses it: its ``--model`` name and its cached directory."""

    name: str
    path: Path

    @property
    def hybrid(self) -> bool:
        return self.name == HYBRID


@pytest.fixture(scope="session", params=TARGETS)
def target_model(request: pytest.FixtureRequest, model_cache: Path) -> TinyTarget:
    """Each embedded target in turn: dense tiny-qwen3, hybrid tiny-qwen3.5 (Qwen3.6's shape).

    A slow test runs the hybrid alone with
    ``@pytest.mark.parametrize("target_model", [HYBRID], indirect=True)``.
    """
    from embedded.tinymodel import ensure_tiny_model

    return TinyTarget(request.param, ensure_tiny_model(model_cache, request.param))


@dataclass
class Pipeline:
    """One test's deployment: environment, CLI runner and worker processes."""

    env: dict[str, str]
    log_dir: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([sys.executable, "-m", "producer.cli", *args], env=self.env,
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        if check:
            assert result.returncode == 0, result.stderr + result.stdout
        return result

    def status(self, run: str) -> dict:
        result = self.cli("status", "--run", run, "--json", check=True)
        return json.loads(result.stdout)

    def read_status(self, run: str) -> dict:
        """What ``status --json`` prints, read in-process by the same code (cheap to poll)."""
        import redis

        from common.storage import open_storage
        from producer.status import StatusReader

        client = redis.Redis.from_url(self.env["DFLASH_BROKER_URL"], decode_responses=True)
        return StatusReader(open_storage(self.env["DFLASH_STORAGE"]), client, run).read()

    def state(self, run: str) -> str:
        return self.read_status(run)["state"]

    def wait_done(self, run: str, timeout: float = 300) -> None:
        wait_until(lambda: self.state(run) == "done", timeout, f"run {run} to finish",
                   interval=0.5)

    def start_worker(self, name: str, *extra: str, kind: str = "generate",
                     **env: str) -> subprocess.Popen[bytes]:
        """A ``worker KIND`` process (generate, hidden or train), once Celery says ready."""
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "producer.cli", "worker", kind, "--name",
                 f"{name}@%h", *extra],
                env={**self.env, **env}, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
            )
        self.workers.append(proc)
        wait_until(lambda: b" ready." in log.read_bytes() or proc.poll() is not None, 120,
                   f"worker {name} to be ready")
        assert proc.poll() is None, log.read_text()[-3000:]
        return proc

    def stop_all(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def pipeline(redis_server: RedisServer, s3_storage: str, model_cache: Path,
             tmp_path: Path) -> Iterator[Pipeline]:
    env = {
        **os.environ,
        "DFLASH_BROKER_URL": redis_server.url,
        "DFLASH_STORAGE": s3_storage,
        "DFLASH_CACHE_DIR": str(model_cache),
        "DFLASH_LEASE_TTL": "4",
        "DFLASH_PART_SAMPLES": "4",
        "DFLASH_BATCH_SIZE": "4",
        "DFLASH_RETRY_BACKOFF_MAX": "2",
        "PYTHONUNBUFFERED": "1",
    }
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    deployment = Pipeline(env=env, log_dir=log_dir)
    yield deployment
    deployment.stop_all()

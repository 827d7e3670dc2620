"""The CLI under a Redis fault: one line and exit 1, no traceback; status says Redis is down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, RedisServer, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def env(redis_server: RedisServer, model_cache: Path, tmp_path: Path) -> dict[str, str]:
    import os

    return {**os.environ, "DFLASH_BROKER_URL": redis_server.url,
            "DFLASH_STORAGE": str(tmp_path / "storage"), "DFLASH_CACHE_DIR": str(model_cache)}


def write_prompts(path: Path, n: int) -> str:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i}."}) + "\n"
                            for i in range(n)))
    return str(path)


def cli(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "producer.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_one_line_failure(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (proc.returncode, out, err)
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Redis" in errors[0], err
    return errors[0]


def test_redis_killed_during_enqueue(env, redis_server: RedisServer, tmp_path: Path) -> None:
    src = write_prompts(tmp_path / "in.jsonl", 20_000)
    proc = cli(env, "enqueue", "--input", src, "--run", "big", "--shard-size", "1")
    inputs = tmp_path / "storage" / "runs" / "big" / "inputs"
    wait_until(lambda: inputs.is_dir() and len(list(inputs.iterdir())) >= 200, 120,
               "enqueue to be writing shards")
    redis_server.kill()
    line = assert_one_line_failure(proc)
    assert "127.0.0.1" in line


def test_redis_killed_during_resume_then_status(env, redis_server: RedisServer,
                                                tmp_path: Path) -> None:
    src = write_prompts(tmp_path / "in.jsonl", 5_000)
    done = subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "--input", src,
                           "--run", "r", "--shard-size", "1"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    client = redis_server.client()
    queued = client.llen("generate")
    proc = cli(env, "resume", "--run", "r", "--force")
    wait_until(lambda: client.llen("generate") > queued + 100, 120, "resume to be queueing")
    redis_server.kill()
    assert_one_line_failure(proc)

    # With Redis down, status still prints what storage says, names what it cannot know, and
    # exits 1 with one line saying why.
    status = subprocess.run([sys.executable, "-m", "producer.cli", "status", "--run", "r",
                             "--json"], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 1, status.stderr
    assert "Traceback" not in status.stderr
    errors = [line for line in status.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot reach Redis" in errors[0], status.stderr
    report = json.loads(status.stdout)
    assert report["redis"] == {"reachable": False, "monitor_ready": False}
    assert report["shards"]["total"] == 5_000 and report["shards"]["running"] is None
    assert report["tokens"]["per_s"] is None and report["eta_s"] is None
    assert report["samples"]["done"] == 0 and report["parked"] is None
    text = subprocess.run([sys.executable, "-m", "producer.cli", "status", "--run", "r"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert text.returncode == 1 and "REDIS UNREACHABLE" in text.stdout, text.stderr


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["resume"], ["report"]])
def test_a_missing_run_is_one_not_found_line_everywhere(env, command: list[str]) -> None:
    proc = cli(env, *command, "--run", "nope")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in err, (out, err)
    assert [line for line in err.splitlines() if line.startswith("error:")] == \
        [f"error: run 'nope' not found in {env['DFLASH_STORAGE']} (no run.json)"], err

"""``dflash-pipeline doctor`` as a real subprocess against real Redis and moto S3.

Run: ``pytest tests/test_doctor.py -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_settings
from producer.doctor.command import check_model, check_model_dir
from tests.conftest import ROOT, RedisServer, free_port

STORAGE_FIX = "check AWS credentials / bucket exists / AWS_ENDPOINT_URL"


@pytest.fixture
def env(redis_server: RedisServer, s3_storage: str, model_cache: Path) -> dict[str, str]:
    """A healthy deployment; COLUMNS keeps every table row on one line for the assertions."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**base, "DFLASH_BROKER_URL": redis_server.url, "DFLASH_STORAGE": s3_storage,
            "DFLASH_CACHE_DIR": str(model_cache), "COLUMNS": "1000"}


def doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "doctor", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def doctor_json(env: dict[str, str], *args: str) -> tuple[int, dict[str, dict]]:
    result = doctor(env, "--json", *args)
    report = json.loads(result.stdout)
    return result.returncode, {c["name"]: c for c in report["checks"]}


def table_row(stdout: str, name: str) -> str:
    rows = [line for line in stdout.splitlines()
            if line.startswith("│") and line.split("│")[1].strip() == name]
    assert len(rows) == 1, stdout
    return rows[0]


def test_healthy_deployment_passes(env: dict[str, str], s3_storage: str) -> None:
    result = doctor(env)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("redis", "redis appendonly", "redis maxmemory-policy", "storage", "model"):
        assert "PASS" in table_row(result.stdout, name)
    # No driver here (WARN), or a clean GPU (PASS): never a failure.
    assert "FAIL" not in result.stdout
    assert " 0 failed" in result.stdout

    code, checks = doctor_json(env)
    assert code == 0
    assert {c["status"] for c in checks.values()} <= {"PASS", "WARN"}
    assert "endpoint http://127.0.0.1:" in checks["storage"]["detail"]
    assert s3_storage in checks["storage"]["detail"]
    # The probe is removed again: doctor leaves nothing in the bucket.
    import boto3

    bucket = s3_storage.removeprefix("s3://").split("/")[0]
    assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket=bucket)


def test_json_shape(env: dict[str, str]) -> None:
    result = doctor(env, "--json")
    report = json.loads(result.stdout)
    assert set(report) == {"ok", "checks"} and report["ok"] is True
    names = [c["name"] for c in report["checks"]]
    assert names[:5] == ["redis", "redis appendonly", "redis maxmemory-policy", "storage",
                         "model"]
    assert names[-1] == "redis-server binary" and "disk (model cache)" in names
    assert any(n.startswith("gpu") for n in names)
    for check in report["checks"]:
        assert set(check) == {"name", "status", "ok", "warn", "detail", "fix"}
        expected = "FAIL" if not check["ok"] else "WARN" if check["warn"] else "PASS"
        assert check["status"] == expected
        assert check["status"] == "PASS" or check["fix"]


def test_risky_redis_config_warns(env: dict[str, str], redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.config_set("appendonly", "no")
    client.config_set("maxmemory-policy", "allkeys-lru")
    code, checks = doctor_json(env)
    assert code == 0
    assert checks["redis appendonly"]["status"] == "WARN"
    assert "appendonly yes" in checks["redis appendonly"]["fix"]
    assert checks["redis maxmemory-policy"]["status"] == "WARN"
    assert "noeviction" in checks["redis maxmemory-policy"]["fix"]


def test_password_is_never_printed(env: dict[str, str], redis_server: RedisServer) -> None:
    redis_server.client().config_set("requirepass", "s3cret-pw")
    good = {**env, "DFLASH_BROKER_URL": f"redis://:s3cret-pw@127.0.0.1:{redis_server.port}/0"}
    passed = doctor(good)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "redis://:***@127.0.0.1" in table_row(passed.stdout, "redis")
    bad = {**env, "DFLASH_BROKER_URL": f"redis://:wrong-pw@127.0.0.1:{redis_server.port}/0"}
    failed = doctor(bad)
    assert failed.returncode == 1
    assert "FAIL" in table_row(failed.stdout, "redis")
    for output in (passed, failed):
        assert "s3cret-pw" not in output.stdout + output.stderr
        assert "wrong-pw" not in output.stdout + output.stderr


def test_missing_bucket_fails_storage(env: dict[str, str]) -> None:
    result = doctor({**env, "DFLASH_STORAGE": "s3://no-such-bucket-dflash/data"})
    assert result.returncode == 1
    row = table_row(result.stdout, "storage")
    assert "FAIL" in row and STORAGE_FIX in row and "no-such-bucket-dflash" in row
    assert "PASS" in table_row(result.stdout, "redis")


def test_unreachable_s3_endpoint_fails_fast(env: dict[str, str]) -> None:
    # doctor()'s 120 s limit: the doctor's client does not retry for minutes.
    code, checks = doctor_json({**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    assert code == 1
    assert checks["storage"]["status"] == "FAIL"
    assert checks["storage"]["fix"] == STORAGE_FIX


def test_unreachable_redis_fails_with_fix(env: dict[str, str]) -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    result = doctor({**env, "DFLASH_BROKER_URL": url})
    assert result.returncode == 1
    row = table_row(result.stdout, "redis")
    assert "FAIL" in row and "redis-server --appendonly yes" in row and "DFLASH_BROKER_URL" in row
    assert "hunter2" not in result.stdout + result.stderr
    assert "redis appendonly" not in result.stdout  # no config rows without a connection
    assert "PASS" in table_row(result.stdout, "storage")


def test_missing_model_dir_fails(env: dict[str, str], tmp_path: Path) -> None:
    code, checks = doctor_json(env, "--model", str(tmp_path / "nope"))
    assert code == 1
    assert checks["model"]["status"] == "FAIL" and "--model" in checks["model"]["fix"]


def test_bad_gpus_option_is_usage_error(env: dict[str, str]) -> None:
    result = doctor(env, "--gpus", "0,x")
    assert result.returncode == 2 and "--gpus" in result.stderr


def test_model_dir_contents(tmp_path: Path, model_cache: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    result = check_model_dir(partial)
    assert not result.ok
    for missing in ("tokenizer", "chat template", "weights"):
        assert missing in result.detail
    assert "lacks config.json" not in result.detail
    (partial / "config.json").unlink()
    assert "lacks config.json;" in check_model_dir(partial).detail

    tiny = check_model(load_settings(env={"DFLASH_CACHE_DIR": str(model_cache)}))
    assert tiny.status == "PASS"
    uncached = check_model(load_settings(env={"DFLASH_CACHE_DIR": str(tmp_path / "empty")}))
    assert uncached.status == "WARN" and "will be built on first use" in uncached.detail
    assert not (tmp_path / "empty").exists()  # checking never starts a build


def test_run_option_says_whether_training_fits_this_host(env: dict[str, str]) -> None:
    """No GPU here: the training-memory row warns and names the command that plans for the GPUs
    the run will train on (the plan itself: tests/test_plan_training.py)."""
    code, checks = doctor_json(env, "--run", "myrun")
    row = checks["training memory"]
    assert code == 0 and row["status"] == "WARN", row
    assert "no GPU here" in row["detail"]
    assert "plan-training --run myrun --num-gpus N --gpu-memory-gib G" in row["fix"]
    bad = doctor(env, "--run", "no/such id")
    assert bad.returncode == 2 and "invalid run id" in bad.stderr

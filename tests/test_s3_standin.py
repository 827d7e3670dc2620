"""The compose stack's S3 side on the host, without Docker: the S3 stand-in
(docker/standins/s3_server.py: moto's server with IAM enforced) and the bucket job
(docker/s3/setup.sh, run by /bin/sh with the stand-in's ``mc``) that creates one user per role
from docs/policies with the key .env gives it. Each role's key may do what its policy says and
is refused the rest; the root key alone administers; keys survive a restart of the server;
the job run again (every start) never takes a working key away, even for a moment; a secret
changed in .env and the job run again rotates it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from producer.demo import free_port
from tests.conftest import ROOT, wait_until

pytestmark = pytest.mark.e2e
ROLES = ("producer", "generate", "hidden", "train", "reader")
ROOT_KEY, ROOT_SECRET = "standin-root", "root-secret-0123"


@dataclass
class StandIn:
    data: Path
    home: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "MINIO_ROOT_USER": ROOT_KEY, "MINIO_ROOT_PASSWORD": ROOT_SECRET}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "docker" / "standins" / "s3_server.py"), "server",
             str(self.data), "--address", f":{self.port}"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def live() -> bool:
            assert self.proc.poll() is None, "the stand-in exited"
            try:
                return urllib.request.urlopen(f"{self.url}/minio/health/live").status == 200
            except OSError:
                return False

        wait_until(live, 60, "the S3 stand-in to answer")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)   # saves its state, as `docker compose stop`
            self.proc.wait(timeout=30)

    def setup(self, **secrets: str) -> subprocess.CompletedProcess[str]:
        """The bucket job as compose runs it, with this role -> secret mapping."""
        env = {"PATH": f"{self.home / 'bin'}:{os.environ['PATH']}", "HOME": str(self.home),
               "S3_URL": self.url, "S3_BUCKET": "dflash", "S3_PREFIX": "pipeline",
               "MINIO_ROOT_USER": ROOT_KEY, "MINIO_ROOT_PASSWORD": ROOT_SECRET,
               "POLICIES": str(ROOT / "docs" / "policies")}
        for role in ROLES:
            env[f"S3_{role.upper()}_KEY"] = f"dflash-{role}"
            env[f"S3_{role.upper()}_SECRET"] = secrets.get(role, f"{role}-secret-1")
        return subprocess.run(["sh", str(ROOT / "docker" / "s3" / "setup.sh")], env=env,
                              capture_output=True, text=True, timeout=300)

    def s3(self, key: str, secret: str):  # noqa: ANN201
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=key, aws_secret_access_key=secret)


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    (tmp_path / "bin").mkdir()
    mc = tmp_path / "bin" / "mc"   # the stand-in image's mc, on this venv's python
    mc.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT}/docker/standins/mc" "$@"\n')
    mc.chmod(0o755)
    server = StandIn(tmp_path / "data", tmp_path, free_port())
    server.start()
    yield server
    server.stop()


def put(client, key: str) -> str:  # noqa: ANN001
    try:
        client.put_object(Bucket="dflash", Key=f"pipeline/{key}", Body=b"x", IfNoneMatch="*")
        return "written"
    except ClientError as exc:
        return exc.response["Error"]["Code"]


def test_the_bucket_job_gives_each_role_its_own_key_and_policy(standin: StandIn) -> None:
    anonymous = standin.s3("nobody", "nobody-secret")
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        anonymous.list_buckets()
    with pytest.raises(urllib.error.HTTPError, match="403"):   # moto's API: no bypass
        urllib.request.urlopen(f"{standin.url}/moto-api/reset", data=b"")
    first = standin.setup()
    assert first.returncode == 0, first.stderr
    made = [f"role {r}: user dflash-{r} with policy dflash-{r}" for r in ROLES]
    assert first.stdout.splitlines() == ["Bucket created successfully `local/dflash`.", *made]
    again = standin.setup()   # every `up`: converges ("policy already attached" is no error)
    assert again.returncode == 0 and again.stdout.splitlines()[1:] == made, again.stderr

    keys = {role: standin.s3(f"dflash-{role}", f"{role}-secret-1") for role in ROLES}
    run = "runs/r1"
    assert put(keys["producer"], f"{run}/run.json") == "written"
    assert put(keys["generate"], f"{run}/generated/shard-000000/part-0000.jsonl.zst") == "written"
    assert put(keys["train"], f"{run}/drafter/step-000001/_COMMIT.json") == "written"
    assert put(keys["hidden"], f"{run}/hidden/shard-000000/_COMMIT.json") == "written"
    for role, key in (("generate", f"{run}/drafter/latest.json"),
                      ("train", f"{run}/generated/shard-000000/_COMMIT.json"),
                      ("hidden", f"{run}/inputs/shard-000000.jsonl.zst"),
                      ("producer", f"{run}/drafter/latest.json"),
                      ("reader", f"{run}/reports/x.png"), ("reader", f"{run}/index/x")):
        assert put(keys[role], key) == "AccessDenied", (role, key)
    listed = keys["reader"].list_objects_v2(Bucket="dflash", Prefix="pipeline/runs/")
    assert len(listed["Contents"]) == 4
    assert keys["reader"].get_object(Bucket="dflash", Key=f"pipeline/{run}/run.json")
    for role in ROLES:   # no role administers users or buckets
        iam = boto3.client("iam", endpoint_url=standin.url, region_name="us-east-1",
                           aws_access_key_id=f"dflash-{role}",
                           aws_secret_access_key=f"{role}-secret-1")
        with pytest.raises(ClientError, match="AccessDenied"):
            iam.create_user(UserName="mine")
        with pytest.raises(ClientError, match="AccessDenied"):
            keys[role].delete_bucket(Bucket="dflash")


def test_keys_survive_a_restart_and_rotate_with_the_next_run_of_the_job(
        standin: StandIn) -> None:
    assert standin.setup().returncode == 0
    standin.stop()
    standin.start()
    old = standin.s3("dflash-generate", "generate-secret-1")
    assert put(old, "runs/r2/generated/shard-000000/a") == "written"
    # The job runs at every `up` (and `compose run`) while the workers work: their keys hold.
    import threading

    errors, stop = [], threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                old.list_objects_v2(Bucket="dflash", Prefix="pipeline/runs/")
            except ClientError as exc:
                errors.append(exc.response["Error"]["Code"])

    worker = threading.Thread(target=work)
    worker.start()
    try:
        assert standin.setup().returncode == 0
    finally:
        stop.set()
        worker.join()
    assert errors == []
    rotated = standin.setup(generate="generate-secret-2")
    assert rotated.returncode == 0, rotated.stderr
    assert put(old, "runs/r2/generated/shard-000000/b") == "SignatureDoesNotMatch"
    new = standin.s3("dflash-generate", "generate-secret-2")
    assert put(new, "runs/r2/generated/shard-000000/b") == "written"


def test_a_placeholder_secret_stops_the_job_with_one_line_before_any_change(
        standin: StandIn) -> None:
    done = standin.setup(reader="change-me-s3-reader")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.splitlines() == [
        "error: S3_READER_SECRET is still .env.example's placeholder (change-me-s3-reader): "
        "set a secret of your own in .env"]
    root = standin.s3(ROOT_KEY, ROOT_SECRET)
    assert root.list_buckets()["Buckets"] == []   # nothing was made

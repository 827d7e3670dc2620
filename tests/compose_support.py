"""The compose project of this checkout, as the compose stack test drives it: an env file made
from .env.example (fresh secrets, free loopback ports, a short run), the docker compose CLI,
the producer's commands, the services' APIs behind their basic auth and writes with a
service's own S3 key."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
RUN = "compose-e2e"
ROWS = 32
# What reaches compose: nothing of the test's own DFLASH_*/AWS_* settings (they would win over
# the env file), only what finds the docker client and its daemon.
PASSED = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "TMPDIR")


class Stack:
    """One compose project of this checkout, driven through the docker compose CLI."""

    def __init__(self, tmp: Path) -> None:
        self.project = f"dflash-test-{os.getpid()}"
        self.env_file, self.export = tmp / "compose.env", tmp / "export"
        self.export.mkdir()
        self.auth = {name: secrets.token_hex(8) for name in ("FLOWER", "UI")}
        self.ports = {"FLOWER": free_port(), "UI": free_port()}
        example = (ROOT / ".env.example").read_text()
        lines = [line.replace("change-me-", f"t{secrets.token_hex(6)}-")
                 for line in example.splitlines()]
        lines += [f"FLOWER_PASSWORD={self.auth['FLOWER']}", f"UI_PASSWORD={self.auth['UI']}",
                  f"FLOWER_PORT={self.ports['FLOWER']}", f"UI_PORT={self.ports['UI']}",
                  "BIND_ADDRESS=127.0.0.1", f"HOST_UID={os.getuid()}",
                  f"HOST_GID={os.getgid()}", f"EXPORT_DIR={self.export}",
                  f"DFLASH_RUN={RUN}", f"DFLASH_LIMIT={ROWS}", "DFLASH_SHARD_SIZE=4",
                  "DFLASH_MAX_NEW_TOKENS=64", "DFLASH_HELDOUT_MIN=2", "DFLASH_EPOCHS=2",
                  # A short lease: a crashed worker's shard is healed within seconds.
                  "DFLASH_LEASE_TTL=15", "DFLASH_TRAIN_EVAL_STEPS=0",
                  "COMPOSE_PROFILES=cpu"]
        self.env_file.write_text("\n".join(lines) + "\n")
        self.settings = dict(line.split("=", 1) for line in lines
                             if line and not line.startswith("#"))
        self.env = {k: v for k, v in os.environ.items() if k in PASSED}

    def compose(self, *args: str, check: bool = True,
                timeout: float = 900) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file), *args]
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {done.returncode}\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def cli(self, *args: str) -> dict[str, Any]:
        """`docker compose run --rm producer dflash-pipeline ...`, its last line as JSON.
        --no-deps: the stack is up; a plain `run` also runs the bucket job again first (it
        converges, in a second with MinIO's mc, 10-20 s with the stand-in's on busy cores)."""
        out = self.compose("run", "--rm", "--no-deps", "-T", "producer", "dflash-pipeline",
                           *args).stdout
        return json.loads(out.strip().splitlines()[-1])

    def status(self) -> dict[str, Any]:
        return self.cli("status", "--run", RUN, "--json")

    def container(self, service: str) -> dict[str, Any]:
        cid = self.compose("ps", "-q", service).stdout.split()[0]
        out = subprocess.run(["docker", "inspect", cid], env=self.env, capture_output=True,
                             text=True, check=True).stdout
        return json.loads(out)[0]

    def get(self, who: str, path: str, auth: bool = True) -> tuple[int, Any]:
        port, user = self.ports[who], "admin"
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if auth:
            token = base64.b64encode(f"{user}:{self.auth[who]}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, None

    def inspect_all(self) -> dict[str, list[dict[str, Any]]]:
        """``docker inspect`` of every container of the project (one-shots too), by service."""
        ids = self.compose("ps", "-a", "-q").stdout.split()
        out = subprocess.run(["docker", "inspect", *ids], env=self.env, capture_output=True,
                             text=True, check=True).stdout
        found: dict[str, list[dict[str, Any]]] = {}
        for info in json.loads(out):
            found.setdefault(info["Config"]["Labels"]["com.docker.compose.service"], []).append(
                info)
        return found

    def put(self, service: str, *keys: str) -> dict[str, str]:
        """Each key (under the storage's prefix) written once with ``service``'s own S3 key,
        from inside its container: "written" or the error code S3 answered."""
        out = self.compose("exec", "-T", service, "python", "-c", PUT, *keys).stdout
        return dict(line.rsplit(" ", 1) for line in out.splitlines())

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout[-12000:]


PUT = """
import os, sys
import boto3
from botocore.exceptions import ClientError
bucket, prefix = os.environ["DFLASH_STORAGE"][5:].split("/", 1)
s3 = boto3.client("s3")
for key in sys.argv[1:]:
    try:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"x", IfNoneMatch="*")
        print(key, "written")
    except ClientError as exc:
        print(key, exc.response["Error"]["Code"])
"""

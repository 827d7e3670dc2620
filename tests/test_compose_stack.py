"""`docker compose up` for real, as a user runs it: scripts/compose-local.sh makes the machine
ready (Docker, Compose, dockerd, images; stand-ins where no image registry answers), then the
`cpu` profile is started, a run is enqueued by the producer service and finishes online, the
generate worker is crashed (kill -9 of its main process) and brought back by its restart policy,
Flower's and the dashboard's APIs are read behind their basic auth, and the stack is taken down
and up on its volumes. Least privilege as the stack runs it (the S3 stand-in enforces IAM, Redis
its ACL users): each service holds its own role's keys, Flower no S3 key, the root key only the
S3 server and the bucket job, no secret is on a command line; the dashboard's keys are refused a
write, each worker's S3 key a write into another stage's area. Ports are published on 127.0.0.1
only; nothing is pulled from a registry (IMAGES=standin); the dockerd this test starts is the
only one it stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.compose_support import ROOT, ROWS, RUN, Stack
from tests.conftest import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("compose")]
RATES = ("tokens", "samples_per_s")   # recomputed from the clock at every read


def _env_of(info: dict[str, Any]) -> dict[str, str]:
    """A container's environment (a name compose passes unset has no "=")."""
    return dict(item.partition("=")[::2] for item in info["Config"]["Env"] or [])


def _finished(stack: Stack) -> dict[str, Any] | None:
    """The status once every shard is generated and trained on in every epoch (the schedule
    made from the data ran to its last step), else None."""
    status = stack.status()
    total = status["shards"]["total"]
    down = status["downstream"]
    done = (status["state"] == "done" and down["committed"] == total > 0
            and down.get("finished") == "schedule")
    return status if done else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("compose")
    pidfile = tmp / "dockerd.pid"
    started = time.monotonic()
    ready = subprocess.run(["bash", "scripts/compose-local.sh", "--pidfile", str(pidfile)],
                           cwd=ROOT, env={**os.environ, "IMAGES": "standin"},
                           capture_output=True, text=True)
    if ready.returncode != 0:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True)
        if info.returncode != 0:
            pytest.skip(f"Docker cannot run here: {(ready.stderr.strip() or '?').splitlines()[-1]}")
        raise AssertionError(f"compose-local.sh failed:\n{ready.stdout}\n{ready.stderr}")
    print(f"compose-local.sh: {time.monotonic() - started:.0f}s")
    stack = Stack(tmp)
    try:
        stack.compose("up", "-d")
        yield stack
    finally:
        print(stack.logs())   # shown where a test failed
        if os.environ.get("DFLASH_KEEP_COMPOSE") is None:
            stack.compose("down", "-v", "--remove-orphans", check=False)
        if pidfile.exists():   # the dockerd compose-local.sh started for this test, only it
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not Path(f"/proc/{pid}").exists(), 60, "dockerd to stop")


def test_a_run_enqueued_by_the_producer_survives_a_worker_crash(stack: Stack) -> None:
    """The producer service enqueues; kill -9 of the generate worker's main process mid-run (what
    the OOM killer does) is undone by the restart policy, and every id is committed once."""
    enqueued = stack.compose("run", "--rm", "-T", "producer").stdout
    assert f"run {RUN}: {ROWS} rows read" in enqueued, enqueued

    def generating() -> dict[str, Any] | None:
        status = stack.status()
        return status if status["samples"]["done"] + status["samples"]["in_progress"] else None

    before = wait_until(generating, 600, "the generate worker to start on the run")
    assert before["state"] != "done", before
    worker = stack.container("generate-cpu")
    restarts, pid = worker["RestartCount"], worker["State"]["Pid"]
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        now = stack.container("generate-cpu")
        return now["RestartCount"] > restarts and now["State"]["Running"]

    wait_until(restarted, 120, "the restart policy to bring the worker back", interval=1)
    status = wait_until(lambda: _finished(stack), 900, "the run to finish", interval=3)
    assert status["samples"]["done"] == ROWS and status["shards"]["parked"] == 0, status
    train = status["downstream"]["train"]
    assert train["epoch"] == train["epochs"] == 2 and train["step"] == train["total_steps"] > 0

    dataset = stack.cli("export-dataset", "--run", RUN, "--out", "/export/dataset",
                        "--format", "parquet", "--split-heldout", "--include-rejected", "--json")
    import pyarrow.parquet as pq

    ids = [i for f in (stack.export / "dataset").rglob("*.parquet")
           for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]
    assert len(ids) == len(set(ids)) == ROWS == sum(dataset["samples"].values())
    drafter = stack.cli("export-drafter", "--run", RUN, "--out", "/export/drafter", "--json")
    assert drafter["step"] >= 1
    config = json.loads((stack.export / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert (stack.export / "drafter" / "model.safetensors").stat().st_uid == os.getuid()


def test_flower_and_the_dashboard_answer_behind_basic_auth(stack: Stack) -> None:
    status = wait_until(lambda: _finished(stack), 900, "the run to finish", interval=3)
    assert stack.get("FLOWER", "/api/workers", auth=False)[0] == 401
    code, workers = stack.get("FLOWER", "/api/workers?refresh=1")
    assert code == 200, code
    names = {name.split("@")[0] for name in workers}
    assert {"generate-cpu", "train-cpu"} <= names, workers
    assert stack.get("UI", f"/api/runs/{RUN}/status", auth=False)[0] == 401
    code, api = stack.get("UI", f"/api/runs/{RUN}/status")
    assert code == 200, code
    cli = stack.status()
    assert {k: v for k, v in api.items() if k not in RATES} == \
        {k: v for k, v in cli.items() if k not in RATES}
    assert api["state"] == status["state"] == "done"


def test_down_and_up_keep_the_run_and_resume_writes_nothing(stack: Stack) -> None:
    wait_until(lambda: _finished(stack), 900, "the run to finish", interval=3)
    # Under <prefix>/runs/: the listing the producer's policy allows (s3:prefix).
    listing = ["python", "-c", "import boto3, os; b, p = os.environ['DFLASH_STORAGE'][5:]"
               ".split('/', 1); s3 = boto3.client('s3'); print(sorted(o['Key'] for page in "
               "s3.get_paginator('list_objects_v2').paginate(Bucket=b, Prefix=p + '/runs/') "
               "for o in page.get('Contents', [])))"]

    def objects() -> str:
        return stack.compose("run", "--rm", "--no-deps", "-T", "producer",
                             *listing).stdout.strip()

    before = objects()
    stack.compose("down")
    stack.compose("up", "-d")
    status = wait_until(lambda: _finished(stack), 300, "the run to read as done after up")
    assert status["samples"]["done"] == ROWS
    report = stack.cli("resume", "--run", RUN, "--json")
    assert report["enqueued"] == 0 and report["downstream"] == 0, report
    assert not report["wrote_inputs"], report
    assert objects() == before


def test_each_service_holds_its_own_roles_keys_and_no_secret_is_on_a_command_line(
        stack: Stack) -> None:
    """Flower holds no S3 key, the dashboard the reader's, each worker its stage's; the S3 root
    key is in the S3 server and the bucket job alone; no password or secret of the env file is
    in any container's command line (what ``docker inspect`` and ``docker top`` show)."""
    wait_until(lambda: _finished(stack), 300, "the run to read as done")
    given = {k: v for k, v in stack.settings.items() if "PASSWORD" in k or "SECRET" in k}
    containers = stack.inspect_all()
    assert {"redis", "minio", "createbuckets", "flower", "ui", "generate-cpu",
            "train-cpu"} <= containers.keys()
    for service, infos in containers.items():
        for info in infos:
            argv = json.dumps([info["Path"], info["Args"], info["Config"]["Cmd"],
                               info["Config"]["Entrypoint"], info["Config"].get("Healthcheck")])
            top = ""   # the processes' own command lines (Redis's after start.sh's exec)
            if info["State"]["Running"]:   # a one-shot may have ended since: no processes
                top = subprocess.run(["docker", "top", info["Id"], "-o", "args"], env=stack.env,
                                     capture_output=True, text=True).stdout
            leaked = [name for name, value in given.items() if value in argv + top]
            assert not leaked, (service, leaked)
            env = _env_of(info)
            holds_root = given["MINIO_ROOT_PASSWORD"] in env.values()
            assert holds_root == (service in ("minio", "createbuckets")), service
    flower = _env_of(containers["flower"][0])
    assert "AWS_ACCESS_KEY_ID" not in flower and "AWS_SECRET_ACCESS_KEY" not in flower
    assert not set(given.values()) - {given["REDIS_FLOWER_PASSWORD"], given["FLOWER_PASSWORD"]} \
        & set(flower.values())
    for service, role in (("ui", "READER"), ("generate-cpu", "GENERATE"), ("train-cpu", "TRAIN")):
        env = _env_of(containers[service][0])
        assert env["AWS_ACCESS_KEY_ID"] == stack.settings[f"S3_{role}_KEY"], service
        assert env["AWS_SECRET_ACCESS_KEY"] == stack.settings[f"S3_{role}_SECRET"], service
        assert env["DFLASH_BROKER_URL"].startswith(f"redis://{role.lower()}:"), service
    made = stack.compose("logs", "--no-color", "createbuckets").stdout
    for role in ("producer", "generate", "hidden", "train", "reader"):
        assert f"role {role}: user dflash-{role} with policy dflash-{role}" in made, made


def test_the_dashboards_keys_are_refused_every_write(stack: Stack) -> None:
    """The dashboard faces the network: its S3 key writes nothing, its Redis user changes
    nothing, while it still reads the run."""
    run = f"runs/{RUN}"
    refused = stack.put("ui", f"{run}/reports/report.png", f"{run}/index/probe",
                        f"{run}/generated/shard-000000/part-9999.jsonl.zst", "runs/other/run.json")
    assert set(refused.values()) == {"AccessDenied"}, refused
    script = ("import os, redis; r = redis.Redis.from_url(os.environ['DFLASH_BROKER_URL']); "
              "print(r.llen('train'), r.exists('dflash:runs'));\n"
              "for cmd in (('SET', 'dflash:x', '1'), ('LPUSH', 'generate', 'm'), "
              "('DEL', 'dflash:runs'), ('FLUSHALL',)):\n"
              "    try: r.execute_command(*cmd); print('allowed', cmd[0])\n"
              "    except redis.exceptions.NoPermissionError: print('refused', cmd[0])")
    out = stack.compose("exec", "-T", "ui", "python", "-c", script).stdout.split("\n")
    assert out[0].split()[0].isdigit(), out   # it reads
    assert out[1:5] == ["refused SET", "refused LPUSH", "refused DEL", "refused FLUSHALL"], out
    assert stack.get("UI", f"/api/runs/{RUN}/status")[0] == 200


def test_each_workers_key_is_refused_a_write_into_another_stages_area(stack: Stack) -> None:
    run = f"runs/{RUN}"
    generate = stack.put("generate-cpu", f"{run}/drafter/step-999999/_COMMIT.json",
                         f"{run}/drafter/latest.json", f"{run}/hidden/shard-000000/_COMMIT.json",
                         f"{run}/inputs/shard-999999.jsonl.zst", f"{run}/run.json")
    assert set(generate.values()) == {"AccessDenied"}, generate
    train = stack.put("train-cpu", f"{run}/generated/shard-000000/part-9999.jsonl.zst",
                      f"{run}/generated/shard-999999/_COMMIT.json",
                      f"{run}/rejected/shard-000000/part-9999.jsonl.zst",
                      f"{run}/inputs/shard-999999.jsonl.zst", f"{run}/run.json")
    assert set(train.values()) == {"AccessDenied"}, train


def test_no_workers_key_reaches_another_stages_area_through_a_wildcard(stack: Stack) -> None:
    """Issue 53, Why 3: in an IAM resource ``*`` matches ``/``, so a grant on ``runs/*/index/*``
    or ``runs/*/drafter/*`` reaches into other areas; the policies' Deny statements keep each
    key in its own (a forged checkpoint or commit would otherwise cost the run its training)."""
    run = f"runs/{RUN}"
    generate = stack.put("generate-cpu", f"{run}/drafter/index/step-000999/_COMMIT.json",
                         f"{run}/hidden/index/x")
    assert set(generate.values()) == {"AccessDenied"}, generate
    train = stack.put("train-cpu", f"{run}/generated/shard-000001/drafter/_COMMIT.json",
                      f"{run}/hidden/shard-000001/drafter/_COMMIT.json")
    assert set(train.values()) == {"AccessDenied"}, train

"""Every role runs its real commands under its own least-privilege S3 policy
(``docs/policies/<role>.json``) on moto's server with IAM enforced, with a storage prefix (the
dense target's run) and without one (the hybrid's): the producer enqueues, the generate, hidden
and train workers finish an online and an offline run, the reconciler passes over them, readers
run ``status``, ``report``, ``export-dataset`` to a local directory, the dashboard's API,
``eval-drafter`` and ``export-drafter`` with a key that may only read, an export to S3 writes
only its own prefix, and ``doctor``'s storage probe works under every key. A worker given a
read-only key stops at start with one line naming the permission it lacks. No key writes into
another stage's area, the forged keys of issue 53 included; an index object forged with a key
that may write the index adds no committed shard.

moto (5.2.x) enforces actions, resources with their wildcards and explicit Deny statements, but
authorizes a request under its API operation's name where AWS and MinIO check a permission:
a HEAD as ``s3:HeadObject`` (AWS: ``s3:GetObject``), a listing as ``s3:ListObjectsV2`` (AWS:
``s3:ListBucket``); :func:`for_moto` adds those names beside the real ones when a file is
loaded here, the files themselves name real IAM actions only. moto evaluates no condition (a
statement's condition always holds there), so the ``s3:prefix`` scope of a listing and
docs/policies/aws/put-once.json are proven by tests/test_policies.py, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import pytest

from producer.demo import free_port
from tests.conftest import ROOT, Pipeline, RedisServer, TinyTarget, wait_until

pytestmark = pytest.mark.e2e

POLICIES = ROOT / "docs" / "policies"
ROLES = ("producer", "generate", "hidden", "train", "reconciler", "reader", "export-s3")
ADMIN_CALLS = 3   # unauthenticated calls moto allows before it enforces IAM: the admin's own


PREFIXES = ("data/", "")   # the storage root with a prefix, and the bucket's root


@dataclass
class IamS3:
    """moto's server enforcing IAM, a bucket, and one user per role with its policy."""

    endpoint: str
    bucket: str
    prefix: str = "data/"
    keys: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def storage(self) -> str:
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}"

    @property
    def root(self) -> str:
        """Where the runs are, as a key prefix of the bucket."""
        return f"{self.prefix}runs"

    def env(self, role: str) -> dict[str, str]:
        key = self.keys[role]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                "DFLASH_STORAGE": self.storage}

    def client(self, role: str, service: str = "s3"):  # noqa: ANN201
        import boto3

        key = self.keys[role]
        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key["AccessKeyId"],
                            aws_secret_access_key=key["SecretAccessKey"])


def policy(role: str, bucket: str, prefix: str) -> str:
    """A role's policy file with this bucket and prefix filled in (as ``envsubst`` would)."""
    text = (POLICIES / f"{role}.json").read_text()
    root = f"{bucket}/{prefix.rstrip('/')}" if prefix else bucket
    return Template(text).substitute(BUCKET=bucket, PREFIX=prefix, ROOT=root,
                                     EXPORT_ROOT=f"{bucket}/exports", EXPORT_BUCKET=bucket,
                                     EXPORT_PREFIX="exports/")


MOTO_NAMES = {"s3:GetObject": ["s3:HeadObject"], "s3:ListBucket": ["s3:ListObjectsV2"]}
"""The operation names moto authorizes a call under, for the IAM permission AWS checks."""


def for_moto(document: str) -> str:
    """A policy as moto can enforce it: moto's operation names beside each real action."""
    policy = json.loads(document)
    for statement in policy["Statement"]:
        actions = statement["Action"]
        statement["Action"] = actions + [n for a in actions for n in MOTO_NAMES.get(a, ())]
    return json.dumps(policy)


@pytest.fixture(scope="module")
def iam_s3s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, IamS3]]:
    """One bucket; for each of :data:`PREFIXES`, one user per role with its policy."""
    import boto3

    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT":
                                     str(ADMIN_CALLS)})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: b"Running on" in log.read_bytes() or proc.poll() is not None, 60,
                   "moto's server to listen")
        assert proc.poll() is None, log.read_text()
        anonymous = {"endpoint_url": endpoint, "region_name": "us-east-1",
                     "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **anonymous)
        iam.create_user(UserName="admin")
        iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*",
                                                     "Resource": "*"}]}))
        bucket, admin = f"lp-{uuid.uuid4().hex[:10]}", iam.create_access_key(UserName="admin")
        s3s = {prefix: IamS3(endpoint, bucket, prefix, {"admin": admin["AccessKey"]})
               for prefix in PREFIXES}
        iam = s3s["data/"].client("admin", "iam")   # IAM is enforced from here on
        s3s["data/"].client("admin").create_bucket(Bucket=bucket)
        for prefix, s3 in s3s.items():
            for role in ROLES:
                user = f"{role}-{prefix.strip('/') or 'root'}"
                iam.create_user(UserName=user)
                iam.put_user_policy(UserName=user, PolicyName=role,
                                    PolicyDocument=for_moto(policy(role, bucket, prefix)))
                s3.keys[role] = iam.create_access_key(UserName=user)["AccessKey"]
        yield s3s
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def iam_s3(iam_s3s: dict[str, IamS3], target_model: TinyTarget) -> IamS3:
    """The dense target's run under a prefix, the hybrid's at the bucket's root."""
    return iam_s3s["" if target_model.hybrid else "data/"]


@pytest.fixture
def deployment(iam_s3: IamS3, redis_server: RedisServer, model_cache: Path,
               tmp_path: Path) -> Iterator[Pipeline]:
    """A Pipeline whose default key is the producer's; each worker gets its own role's."""
    env = {**os.environ, **iam_s3.env("producer"), "DFLASH_BROKER_URL": redis_server.url,
           "DFLASH_CACHE_DIR": str(model_cache), "DFLASH_LEASE_TTL": "4",
           "DFLASH_PART_SAMPLES": "4", "DFLASH_BATCH_SIZE": "4",
           "DFLASH_RETRY_BACKOFF_MAX": "2", "PYTHONUNBUFFERED": "1"}
    (tmp_path / "logs").mkdir()
    pipeline = Pipeline(env=env, log_dir=tmp_path / "logs")
    yield pipeline
    pipeline.stop_all()


def as_role(pipeline: Pipeline, iam_s3: IamS3, role: str, *args: str
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args],
                          env={**pipeline.env, **iam_s3.env(role)}, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def refused(client, bucket: str, key: str) -> bool:  # noqa: ANN001
    from botocore.exceptions import ClientError

    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"x", IfNoneMatch="*")
    except ClientError as exc:
        return exc.response["Error"]["Code"] == "AccessDenied"
    return False


def test_each_role_runs_its_commands_under_its_own_policy(
        deployment: Pipeline, iam_s3: IamS3, tmp_path: Path, target_model: TinyTarget) -> None:
    from common.runs.checkpoints import read_ledger
    from common.storage import open_storage
    from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
    from tests.test_train_e2e import TRAIN_ENV
    from tests.ui_support import running_ui

    pipeline, run = deployment, f"lp-{target_model.name.replace('.', '-')}"
    pipeline.env["DFLASH_MODEL"] = target_model.name
    reader = {**pipeline.env, **iam_s3.env("reader")}

    # A worker with a read-only key stops at start, one line naming the permission, no shard.
    for kind, area in (("generate", "generated"), ("train", "drafter"), ("hidden", "hidden")):
        stopped = as_role(pipeline, iam_s3, "reader", "worker", kind)
        lines = stopped.stderr.strip().splitlines()
        assert stopped.returncode == 1 and len(lines) == 1, stopped.stderr[-2000:]
        assert lines[0].startswith("error: ") and "s3:PutObject" in lines[0], lines
        assert f"runs/*/{area}/*" in lines[0] and "AccessDenied" in lines[0], lines

    wrong = as_role(pipeline, iam_s3, "generate", "worker", "train")   # another stage's key
    assert wrong.returncode == 1 and "runs/*/drafter/*" in wrong.stderr, wrong.stderr

    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    enqueue = ("enqueue", "--input", src, "--run", run, "--shard-size", "4", "--mode", "online",
               "--epochs", "1", "--max-new-tokens", "64", "--heldout-min", "2")
    denied = as_role(pipeline, iam_s3, "reader", *enqueue)
    assert denied.returncode == 1 and "AccessDenied" in denied.stderr, denied.stderr
    pipeline.start_worker("gen", **iam_s3.env("generate"))
    pipeline.start_worker("trainer", kind="train", **{**TRAIN_ENV, **iam_s3.env("train")})
    pipeline.start_worker("hid", kind="hidden", **iam_s3.env("hidden"))
    pipeline.cli(*enqueue, check=True)
    offline = f"{run}-off"   # generate -> hidden states stored -> trained from them
    pipeline.cli("enqueue", "--input", src, "--run", offline, "--shard-size", "4", "--limit",
                 "4", "--epochs", "1", "--max-new-tokens", "64", "--heldout-min", "0", check=True)
    during = as_role(pipeline, iam_s3, "reader", "status", "--run", run, "--json")
    assert during.returncode == 0 and json.loads(during.stdout)["run"] == run, during.stderr

    admin = open_storage(iam_s3.storage)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in iam_s3.env("admin").items():
            patch.setenv(name, value)
        wait_until(lambda: sorted(read_ledger(admin, run).done) == [0, 1], 300,
                   "both shards trained")
        wait_until(lambda: read_ledger(admin, offline).done == [0], 300,
                   "the offline shard trained from its stored hidden states")
        assert list(admin.list(f"runs/{offline}/hidden/"))
    status = as_role(pipeline, iam_s3, "reader", "status", "--run", run, "--json")
    writer = as_role(pipeline, iam_s3, "producer", "status", "--run", run, "--json")
    assert status.returncode == 0 and status.stderr == "", status.stderr
    seen, truth = json.loads(status.stdout), json.loads(writer.stdout)
    assert seen["state"] == truth["state"] == "done" and seen["samples"] == truth["samples"]
    assert seen["parked"] == [] and seen["downstream"]["committed"] == 2

    report = as_role(pipeline, iam_s3, "reader", "report", "--run", run)
    assert report.returncode == 0 and report.stderr == "", report.stderr
    assert "PNG not stored in the run's storage (AccessDenied" in report.stdout, report.stdout
    png = tmp_path / "report.png"
    local = as_role(pipeline, iam_s3, "reader", "report", "--run", run, "--png", str(png))
    assert local.returncode == 0 and f"written to {png} only" in local.stdout, local.stdout
    assert png.read_bytes().startswith(b"\x89PNG")

    exported = as_role(pipeline, iam_s3, "reader", "export-dataset", "--run", run, "--out",
                       str(tmp_path / "export"), "--format", "parquet", "--json")
    assert exported.returncode == 0 and exported.stderr == "", exported.stderr
    samples = json.loads(exported.stdout)["samples"]
    assert sum(samples.values()) > 0 and (tmp_path / "export").is_dir()
    to_s3 = ("export-dataset", "--run", run, "--out", f"s3://{iam_s3.bucket}/exports/{run}",
             "--format", "parquet", "--json")
    denied = as_role(pipeline, iam_s3, "reader", *to_s3)
    assert denied.returncode == 1 and "StorageRefused" in denied.stderr, denied.stderr
    to = as_role(pipeline, iam_s3, "export-s3", *to_s3)
    assert to.returncode == 0 and json.loads(to.stdout)["samples"] == samples, to.stderr

    evaluated = as_role(pipeline, iam_s3, "reader", "eval-drafter", "--run", run,
                        "--max-new-tokens", "16", "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(evaluated.stdout)["lossless"]["mismatches"] == []
    # --dataset stores its table under the run: the train worker's key may, a reader's not.
    sets = ("eval-drafter", "--run", run, "--dataset", src, "--num", "1", "--max-new-tokens",
            "8", "--json")
    unstored = as_role(pipeline, iam_s3, "reader", *sets)
    assert unstored.returncode == 0 and json.loads(unstored.stdout)["stored"] is None
    assert "eval not stored in the run's storage (AccessDenied" in unstored.stderr
    stored = as_role(pipeline, iam_s3, "train", *sets)
    assert stored.returncode == 0, stored.stderr[-2000:]
    key = json.loads(stored.stdout)["stored"]
    shown = as_role(pipeline, iam_s3, "reader", "report", "--run", run, "--json", "--no-png")
    assert json.loads(shown.stdout)["eval"]["key"] == key and key.endswith(".json")

    drafter = as_role(pipeline, iam_s3, "reader", "export-drafter", "--run", run, "--out",
                      str(tmp_path / "drafter"), "--json")
    assert drafter.returncode == 0, drafter.stderr[-2000:]
    assert (tmp_path / "drafter" / "config.json").is_file()

    with running_ui(reader, tmp_path / "ui.log") as ui:
        api = ui.json(f"/api/runs/{run}/status")
        assert api["state"] == "done" and api["samples"] == truth["samples"]
        assert {r["run"] for r in ui.json("/api/runs")["runs"]} >= {run, offline}

    resumed = as_role(pipeline, iam_s3, "reconciler", "resume", "--run", run, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["enqueued"] == 0

    # Least: each worker's key writes its own stage's area and no other's, whatever its
    # wildcards match (issue 53: "runs/*/index/*" matches runs/R/drafter/index/...).
    bucket, root = iam_s3.bucket, f"{iam_s3.root}/{run}"
    assert refused(iam_s3.client("generate"), bucket, f"{root}/drafter/x")
    assert refused(iam_s3.client("train"), bucket, f"{root}/generated/x")
    assert refused(iam_s3.client("reconciler"), bucket, f"{root}/generated/x")
    assert refused(iam_s3.client("producer"), bucket, f"{root}/drafter/x")
    assert refused(iam_s3.client("hidden"), bucket, f"{root}/generated/x")
    assert refused(iam_s3.client("export-s3"), bucket, f"{root}/generated/x")
    forged = {f"{root}/drafter/index/step-000999/_COMMIT.json": ("producer", "generate",
                                                                  "hidden", "reconciler"),
              f"{root}/generated/shard-000001/drafter/_COMMIT.json": ("train", "producer",
                                                                      "hidden", "reconciler"),
              f"{root}/hidden/shard-000001/index/_COMMIT.json": ("generate", "train"),
              f"{root}/inputs/gates/shard-000001.jsonl.zst": ("generate",)}
    for key, roles in forged.items():
        assert all(refused(iam_s3.client(role), bucket, key) for role in roles), key
    check_doctor_under_every_key(pipeline, iam_s3)
    check_a_forged_index_object(iam_s3, run, reader, truth)


def check_doctor_under_every_key(pipeline: Pipeline, iam_s3: IamS3) -> None:
    """doctor's probe goes into the key's own areas: it passes under every role's key (a
    reader's is a read-only WARN) and names the areas the key may write."""
    from producer.doctor.storage import check_storage

    writes = {"producer": ["inputs/", "index/"], "generate": ["generated/", "index/"],
              "hidden": ["hidden/", "index/"], "train": ["drafter/", "index/"],
              "reconciler": ["index/"], "reader": [], "export-s3": []}
    for role, areas in writes.items():
        with pytest.MonkeyPatch.context() as patch:
            for name, value in iam_s3.env(role).items():
                patch.setenv(name, value)
            row = check_storage(iam_s3.storage)
        assert row.ok and row.warn == (not areas), (role, row)
        written = row.detail.split(" in: ")[-1] if areas else ""
        assert [a for a in ("generated/", "hidden/", "drafter/", "inputs/", "index/")
                if f"{a} (" in written] == areas, (role, row.detail)
    doctor = as_role(pipeline, iam_s3, "reconciler", "doctor", "--json")
    [row] = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "storage"]
    assert row["status"] == "PASS" and "index/ (reconciler)" in row["detail"], row


def check_a_forged_index_object(iam_s3: IamS3, run: str, reader: dict[str, str],
                                truth: dict) -> None:
    """The reconciler's key may write the index: an object claiming shards without a commit
    (0, 1 are real; 5 is not) changes no reader's count and queues nothing."""
    import zstandard

    body = {"v": 1, "run": run, "kind": "digests", "chunk": 0, "shards": {
        str(s): {"samples": 4, "rejected": 0, "stats": {}, "part_stats": {}, "worker": "w",
                 "committed_at": 0.0} for s in (0, 1, 5)}}
    key = f"{iam_s3.root}/{run}/index/digests/chunk-0000-003-0badc0de.json.zst"
    iam_s3.client("reconciler").put_object(
        Bucket=iam_s3.bucket, Key=key, IfNoneMatch="*",
        Body=zstandard.ZstdCompressor().compress(json.dumps(body).encode()))
    status = subprocess.run([sys.executable, "-m", "producer.cli", "status", "--run", run,
                             "--json"], env=reader, capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    seen = json.loads(status.stdout)
    assert seen["shards"]["committed"] == truth["shards"]["committed"] == 2
    assert seen["samples"]["done"] == truth["samples"]["done"]
    resumed = subprocess.run([sys.executable, "-m", "producer.cli", "resume", "--run", run,
                              "--json"], env={**reader, **iam_s3.env("reconciler")},
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["enqueued"] == 0

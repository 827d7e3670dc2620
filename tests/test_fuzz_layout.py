"""No object a role may write can stop another: a fuzz test of the whole storage layout.

A real run is generated and trained under each role's least-privilege key on moto's server with
IAM enforced (tests/test_least_privilege.py's). Then, batch by seeded batch, every role writes
with its own key, at every kind of key the layout has that its policy lets it write
(tests/fuzz_objects.py derives the cases from ``common.key_layout`` and docs/policies), every
body family of that object's format: the wrong type at one field of a real record, JSON of
another type, not JSON, empty, deep nesting with a lone surrogate, NaN, 4M small rows under
the cap, a zstd frame stating 2 GiB, truncated zstd, a frame hiding its size, a pickle where a
tensor file goes, safetensors header bombs; kinds a writer replaces are also written over the
run's real objects. After each batch: a reconciler pass over the run completes, a new run
trains to its end beside the forgeries and parks nothing, ``status``, ``report``, ``resume
--dry-run``, ``export-dataset``, ``export-drafter`` and every dashboard panel answer (HTTP 200),
the committed counts are unchanged, every worker and its threads live, no pickle ran, and no
process of the stack held more than :data:`MEMORY_BOUND` at its peak. Seeds that once failed
stay in :data:`REGRESSIONS`.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import ROOT, Pipeline, RedisServer, wait_until
from tests.fuzz_objects import PWNED, ROLES, Family, bodies, forgeries, layouts, writers
from tests.test_least_privilege import IamS3, iam_s3s  # noqa: F401 - the moto IAM fixture

pytestmark = pytest.mark.e2e

SEEDS = (1, 2)      # each a batch of forgeries, then a run trained beside them
REGRESSIONS: tuple[int, ...] = ()   # seeds that once failed, run first
GiB = 2**30
MEMORY_BOUND = int(1.5 * GiB)   # any process of the stack, at its peak (a bomb inflates to 2)
# The readers' caps, lower than the defaults so that a bomb is far past them.
CAPS = {"DFLASH_READ_JSON_BYTES": str(4 * 2**20), "DFLASH_READ_INDEX_BYTES": str(2**20),
        "DFLASH_READ_INDEX_DECODED_BYTES": str(16 * 2**20),
        "DFLASH_READ_PART_BYTES": str(16 * 2**20),
        "DFLASH_READ_PART_DECODED_BYTES": str(256 * 2**20)}
TRAIN = {"DFLASH_TRAIN_CHECKPOINT_STEPS": "2", "DFLASH_TRAIN_ROWS_PER_STEP": "4",
         "DFLASH_TRAIN_MAX_ANCHORS": "16", "DFLASH_TRAIN_EVAL_STEPS": "0"}


@pytest.fixture
def stack(iam_s3s: dict[str, IamS3], redis_server: RedisServer, model_cache: Path,  # noqa: F811
          tmp_path: Path) -> Iterator[tuple[Pipeline, IamS3]]:
    """The dense target's deployment under a storage prefix; the producer's key by default."""
    s3 = iam_s3s["data/"]
    env = {**os.environ, **s3.env("producer"), **CAPS, "DFLASH_BROKER_URL": redis_server.url,
           "DFLASH_CACHE_DIR": str(model_cache), "DFLASH_LEASE_TTL": "4",
           "DFLASH_PART_SAMPLES": "4", "DFLASH_BATCH_SIZE": "4",
           "DFLASH_RETRY_BACKOFF_MAX": "2", "PYTHONUNBUFFERED": "1"}
    (tmp_path / "logs").mkdir()
    pipeline = Pipeline(env=env, log_dir=tmp_path / "logs")
    yield pipeline, s3
    pipeline.stop_all()


def as_role(pipeline: Pipeline, s3: IamS3, role: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args],
                          env={**pipeline.env, **s3.env(role)}, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def admin_storage(s3: IamS3) -> Any:
    from common.config import load_settings
    from common.storage import open_storage

    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3.env("admin").items():
            patch.setenv(name, value)
        storage = open_storage(s3.storage, load_settings(CAPS).read)
        storage.client   # noqa: B018 - the admin's client, made while its key is set
    return storage


def run_trained(pipeline: Pipeline, s3: IamS3, run: str, rows: int, src: Path) -> None:
    """Enqueue ``run`` (online, one epoch) and wait until its trainer finished; nothing parks."""
    from common.runs.checkpoints import read_ledger

    pipeline.cli("enqueue", "--input", str(src), "--run", run, "--shard-size", "4", "--limit",
                 str(rows), "--mode", "online", "--epochs", "1", "--max-new-tokens", "64",
                 "--heldout-min", "1", check=True)
    admin = admin_storage(s3)
    wait_until(lambda: read_ledger(admin, run).finished, 300, f"run {run} trained")
    status = json.loads(as_role(pipeline, s3, "reader", "status", "--run", run, "--json").stdout)
    assert status["parked"] == [] and status["downstream"]["parked"] == 0, status["parked"]


def templates(storage: Any, run: str) -> dict[str, Any]:
    """Real records of ``run`` for the forgeries to take apart, and its real keys by kind."""
    from common import keys
    from common.runs.checkpoints import readable_commits
    from common.runs.records import decode_jsonl_zst

    commits = sorted(k for k in storage.list(keys.generated_prefix(run))
                     if keys.commit_shard(k) is not None)
    commit = json.loads(storage.get(commits[0]))
    part = next(p for p in commit["parts"] if "/generated/" in p)
    checkpoint = next(readable_commits(storage, run))[1]
    existing: dict[str, list[str]] = {}
    for key in storage.list(f"runs/{run}/"):
        if (parsed := keys.parse(key)) is not None:
            existing.setdefault(parsed.kind.value, []).append(key)
    return {
        "run": json.loads(storage.get(keys.run_config(run))),
        "manifest": json.loads(storage.get(keys.inputs_manifest(run))),
        "commit": commit, "checkpoint": checkpoint,
        "latest": json.loads(storage.get(keys.drafter_latest(run))),
        "sample": decode_jsonl_zst(storage.get(part))[0],
        "input_row": decode_jsonl_zst(storage.get(keys.input_shard(run, 0)))[0],
        "resume": {"accepted": True, "checked": 1, "max_reject_rate": 0.5, "pause_after": 10},
        "pause": {"reason": "forged", "at": 1.0},
        "failed": {"run": run, "shard": 0, "stage": "generate", "error": "forged", "at": 1.0},
        "bench": {"run": run, "gpu": "unknown", "tp": 1, "engine": "0123abcd",
                  "stamp": "20260101T000000.000000", "rows": [
                      {"mtp": "off", "concurrency": 8, "output_tokens_per_s": 100.0},
                      {"mtp": "on", "concurrency": 8, "output_tokens_per_s": 200.0}]},
        "index": {"v": 2, "run": run, "kind": "commits", "chunk": 0, "shards": {
            str(commit["shard"]): {"etag": "0" * 32, "size": 1, "body": "{}"}}},
        "index_count": len(commits),
        "existing": {kind: found for kind, found in existing.items() if kind in REPLACED}}


REPLACED = ("run-index object", "gate event", "latest checkpoint pointer", "parking record",
            "bench verdict", "report", "access probe")
"""Kinds whose real objects the fuzz writes over: what a writer replaces, or derived data; the
records that hold a run's truth (inputs, parts, commits, checkpoints) are put once by
docs/policies/aws/put-once.json, and a key that may write them over on MinIO is that stage's."""


def write_batch(s3: IamS3, seed: int, batch: int, run: str, found: dict[str, Any],
                fresh: bool) -> int:
    """The seed's forgeries against ``run``, each put with its role's key (refused ones
    skipped); how many landed. A ``fresh`` run (not enqueued yet) keeps its manifest's key free
    (a producer forging its own run's manifest stops only its own enqueue) and gets no pause
    records: a pause, readable or not, pauses the run (gates fail closed), which is its
    purpose; the run beside takes them after it finished."""
    from botocore.exceptions import ClientError

    landed, clients = 0, {role: s3.client(role) for role in ROLES}
    for forged in forgeries(random.Random(seed), run, found, batch):
        if fresh and (forged.key.endswith("/inputs/_MANIFEST.json")
                      or "/gates/pause-" in forged.key):
            continue
        once = {} if forged.overwrite else {"IfNoneMatch": "*"}
        try:
            clients[forged.role].put_object(Bucket=s3.bucket, Key=s3.prefix + forged.key,
                                              Body=forged.body, **once)
            landed += 1
        except ClientError as exc:
            assert exc.response["Error"]["Code"] in ("AccessDenied", "PreconditionFailed"), (
                forged, exc)
    return landed


def check_readers(pipeline: Pipeline, s3: IamS3, run: str, truth: dict[str, Any],
                  tmp_path: Path) -> None:
    """Every reader answers, with the run's own counts."""
    from tests.ui_support import running_ui

    status = as_role(pipeline, s3, "reader", "status", "--run", run, "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    seen = json.loads(status.stdout)
    assert seen["shards"]["committed"] == truth["shards"]["committed"]
    assert seen["samples"] == truth["samples"] and seen["state"] == "done"
    assert seen["foreign_objects"], "the forged objects status met were not counted"
    for args in (("report", "--run", run, "--json", "--no-png"),
                 ("export-dataset", "--run", run, "--out", str(tmp_path / "export"),
                  "--format", "parquet", "--json"),
                 ("export-drafter", "--run", run, "--out", str(tmp_path / "drafter"), "--json")):
        result = as_role(pipeline, s3, "reader", *args)
        assert result.returncode == 0, (args, result.stderr[-2000:])
    dry = as_role(pipeline, s3, "reconciler", "resume", "--run", run, "--dry-run", "--json")
    assert dry.returncode == 0 and json.loads(dry.stdout)["enqueued"] == 0, dry.stderr[-2000:]
    reader = {**pipeline.env, **s3.env("reader")}
    with running_ui(reader, tmp_path / "ui.log") as ui:
        rows = {r["run"]: r for r in ui.json("/api/runs")["runs"]}
        assert rows[run]["state"] == "done" and "error" not in rows[run]
        forged = [r for name, r in rows.items() if name.startswith(f"{run}-f")]
        assert forged and any("error" in r for r in forged), rows   # foreign run.json: a row
        for panel in PANELS:
            code, _ = ui.get(f"/api/runs/{run}/{panel}")
            assert code == 200, panel
        assert ui.json("/api/runs")["runs"], "the dashboard stopped answering"


PANELS = ("status", "series", "series?live=1", "shards", "gates", "engines", "evals")


def check_alive(pipeline: Pipeline) -> None:
    """Every worker process is up and none of their threads died of an exception; no pickle
    ran its payload."""
    for worker in pipeline.workers:
        assert worker.poll() is None, f"worker {worker.pid} exited"
    for log in pipeline.log_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Exception in thread" not in text, (log.name, text[-3000:])
    assert not Path(PWNED).exists(), "a forged pickle was loaded"


def check_reconciler(s3: IamS3, redis_url: str, runs: list[str]) -> None:
    """A pass over each run completes (in this process: an exception would surface here)."""
    import redis

    from common.config import load_settings
    from common.queue.celery_app import make_app
    from common.queue.reconcile import reconcile_run, waiting_messages
    from common.storage import open_storage

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3.env("reconciler").items():
            patch.setenv(name, value)
        settings = load_settings({**CAPS, "DFLASH_BROKER_URL": redis_url})
        storage = open_storage(s3.storage, settings.read)
        app = make_app(settings)
        for run in runs:
            assert reconcile_run(storage, app, client, run, 4.0,
                                 waiting_messages(client)) is not None, run


def peak_rss(pipeline: Pipeline) -> int:
    """The most any process of the stack held: the CLI processes run so far, and the workers
    (their ranks included) now."""
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    for worker in pipeline.workers:
        for proc in [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(True)]:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            hwm = next(line for line in status.splitlines() if line.startswith("VmHWM"))
            peak = max(peak, int(hwm.split()[1]) * 1024)
    return peak


def test_no_object_a_role_may_write_stops_another(stack: tuple[Pipeline, IamS3],
                                                  tmp_path: Path) -> None:
    from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl

    pipeline, s3 = stack
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
    pipeline.start_worker("gen", **s3.env("generate"))
    pipeline.start_worker("trainer", kind="train", **{**TRAIN, **s3.env("train")})
    run = "fz"
    run_trained(pipeline, s3, run, 8, src)
    truth = json.loads(as_role(pipeline, s3, "reader", "status", "--run", run, "--json").stdout)
    found = templates(admin_storage(s3), run)
    for batch, seed in enumerate((*REGRESSIONS, *SEEDS)):
        beside = f"fz-{seed}"   # forged before it starts: its trainer meets them all
        assert write_batch(s3, seed, batch, run, found, fresh=False) > 40, seed
        assert write_batch(s3, seed + 1000, 0, beside, found, fresh=True) > 40, seed
        run_trained(pipeline, s3, beside, 4, src)   # the trainer trains on, parks nothing
        check_reconciler(s3, pipeline.env["DFLASH_BROKER_URL"], [run, beside])
        check_readers(pipeline, s3, run, truth, tmp_path / f"seed-{seed}")
        check_alive(pipeline)
        assert peak_rss(pipeline) < MEMORY_BOUND, f"seed {seed}: {peak_rss(pipeline) / GiB:.2f}"


def test_every_layout_kind_is_fuzzed() -> None:
    """The cases come from the layout and the policies: every kind of key has a layout, each
    parses to its kind, every writer role writes some, each format gets its body families."""
    from common import keys
    from common.key_layout import KeyKind

    found = layouts(3)
    assert {layout.kind for layout in found} == set(KeyKind)
    for layout in found:
        parsed = keys.parse(layout.key("fz", 7))
        assert parsed is not None and parsed.kind is layout.kind, layout
    written = {role for layout in found for role in writers(layout.key("fz", 7))}
    assert written == {"producer", "generate", "hidden", "train", "reconciler"}
    rng = random.Random(0)
    whats = {family: " | ".join(w for _, w in bodies(rng, family, {"a": [1], "b": 2.0}))
             for family in Family}
    for family, needed in ((Family.JSON, ("deep nesting", "NaN", "wrong type")),
                           (Family.JSONL_ZST, ("many small rows", "states 2 GiB", "truncated")),
                           (Family.SAFETENSORS, ("header that states", "pickle")),
                           (Family.TORCH, ("pickle",))):
        assert all(n in whats[family] for n in needed), (family, whats[family])
    assert not Path(PWNED).exists()

"""End to end on real Redis, real Celery worker processes, moto's S3 server and the CPU model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import boto3
import pytest

from common import keys
from common.queue import redis_keys
from common.runs.records import decode_jsonl_zst
from common.storage import open_storage
from tests.conftest import MT_BENCH, Pipeline, RedisServer, TinyTarget, wait_until

pytestmark = pytest.mark.e2e


def _mt_bench_rows(n: int) -> list[dict]:
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return rows[:n]


def _write_jsonl(path, rows) -> str:  # noqa: ANN001
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _commits(storage_url: str, run: str) -> dict[int, dict]:
    storage = open_storage(storage_url)
    return {
        keys.shard_of(k): json.loads(storage.get(k))
        for k in storage.list(keys.generated_prefix(run)) if k.endswith("_COMMIT.json")
    }


def _committed_samples(storage_url: str, run: str) -> list[dict]:
    """Every canonical sample, accepted or rejected by the gates, read through the commits."""
    storage = open_storage(storage_url)
    samples = []
    for commit in _commits(storage_url, run).values():
        wanted = set(commit["sample_ids"]) | set(commit["rejected_ids"])
        for part in commit["parts"]:
            for sample in decode_jsonl_zst(storage.get(part)):
                if sample["id"] in wanted and commit["part_of"][sample["id"]] == part:
                    samples.append(sample)
    return samples


def _all_keys(storage_url: str) -> list[str]:
    return list(open_storage(storage_url).list("runs/"))


def _queue_len(redis_server: RedisServer, queue: str = "generate") -> int:
    return redis_server.client().llen(queue)


def test_status_progress_then_rerun_writes_and_queues_nothing(
        pipeline: Pipeline, redis_server: RedisServer, tmp_path,  # noqa: ANN001
        target_model: TinyTarget) -> None:
    pipeline.env["DFLASH_MODEL"] = target_model.name
    # The hybrid decodes through torch's slow Gated DeltaNet fallback: half the rows, 3 shards.
    n, size = (6, "2") if target_model.hybrid else (12, "4")
    rows = _mt_bench_rows(n)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    pipeline.cli("enqueue", "--input", src, "--run", "r1", "--shard-size", size,
                 "--max-new-tokens", "96", check=True)
    assert pipeline.status("r1")["state"] == "pending"
    # A pause after each commit keeps the run part-way for a few seconds, so that a status
    # poll (a process of its own, seconds on busy cores) cannot miss every part-way moment.
    pipeline.start_worker("w1", DFLASH_TEST_FAULT="generate.hand_off=sleep:4")
    seen = []

    def finished() -> bool:
        status = pipeline.status("r1")
        seen.append(status)
        return status["state"] == "done"

    wait_until(finished, 300, "run r1 to finish", interval=1.0)
    running = [s for s in seen if s["state"] == "running"]
    assert running, "status never reported the run as running"
    assert any(0 < s["samples"]["done"] + s["samples"]["in_progress"] < n for s in running)
    final = seen[-1]
    assert final["shards"] == {**final["shards"], "total": 3, "committed": 3}
    assert final["samples"]["done"] == n and final["samples"]["input_rejected"] == 0
    assert final["tokens"]["generated"] > 0

    before, queued = _all_keys(pipeline.env["DFLASH_STORAGE"]), _queue_len(redis_server)
    again = pipeline.cli("enqueue", "--input", src, "--run", "r1", "--shard-size", size,
                         "--max-new-tokens", "96", "--json", check=True)
    assert json.loads(again.stdout)["enqueued"] == 0
    resumed = pipeline.cli("resume", "--run", "r1", "--json", check=True)
    assert json.loads(resumed.stdout)["enqueued"] == 0
    assert _all_keys(pipeline.env["DFLASH_STORAGE"]) == before
    assert _queue_len(redis_server) == queued == 0


def _interrupt_mid_shard(pipeline: Pipeline, src: str, run: str, shard_size: int,
                         sig: signal.Signals, **worker_env: str) -> set[str]:
    """Enqueue, let a worker write its first part, signal it; returns the ids kept in parts."""
    pipeline.cli("enqueue", "--input", src, "--run", run, "--shard-size", str(shard_size),
                 "--max-new-tokens", "96", check=True)
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    victim = pipeline.start_worker("victim", **worker_env)
    wait_until(lambda: storage.exists(keys.generated_part(run, 0, 0)), 300, "a first part")
    victim.send_signal(sig)
    victim.wait(timeout=60)
    assert not storage.exists(keys.generated_commit(run, 0)), "shard 0 finished before the signal"
    # Samples that failed a gate are kept too, in rejected parts: neither is generated again.
    parts = [*storage.list(keys.generated_prefix(run)), *storage.list(keys.rejected_prefix(run))]
    kept = {s["id"] for k in parts
            if keys.part_number(k) is not None for s in decode_jsonl_zst(storage.get(k))}
    assert kept, "no sample was written before the signal"
    return kept


def test_kill9_mid_shard_then_resume_regenerates_only_missing(
        pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    rows = _mt_bench_rows(32)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    kept = _interrupt_mid_shard(pipeline, src, "k9", 16, signal.SIGKILL)
    storage_url = pipeline.env["DFLASH_STORAGE"]

    pipeline.start_worker("rescuer")
    report = json.loads(pipeline.cli("resume", "--run", "k9", "--json", check=True).stdout)
    pipeline.wait_done("k9")
    # The rescuer's reconciler may have queued a shard the killed worker held before resume did.
    healed = (pipeline.log_dir / "rescuer.log").read_text().count("queued again")
    assert report["enqueued"] + healed == 2

    samples = _committed_samples(storage_url, "k9")
    ids = [s["id"] for s in samples]
    assert sorted(ids) == sorted(str(r["question_id"]) for r in rows)
    assert len(ids) == len(set(ids))
    requests = pipeline_requests(pipeline, "k9", "rescuer@")
    expected = sum(sent_requests(s) for s in samples if s["id"] not in kept)
    assert requests == expected, (requests, expected, len(kept))


def sent_requests(sample: dict) -> int:
    """Requests a sample's record says were sent: its kept turns and the turn that stopped it
    (a conversation stops at its first rejected turn), less those fitted out before sending."""
    stopped = sample["quality"].get("stopped")
    turns = sample["turns"] + ([stopped] if stopped else [])
    return sum((t.get("refused") or {}).get("reason") != "context_overflow" for t in turns)


def pipeline_requests(pipeline: Pipeline, run: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(pipeline.env["DFLASH_BROKER_URL"], decode_responses=True)
    counts = client.hgetall(redis_keys.RunKeys(run).requests)
    return sum(int(v) for k, v in counts.items() if k.startswith(prefix))


BAD_ROWS = [
    b'{"id": "ok-1", "messages": [{"role": "user", "content": "Name three rivers."}]}',
    b'{"id": "broken", "messages": [',
    b'{"id": "utf8", "prompt": "caf\xc3\x28"}',
    b'{"id": "nouser", "messages": [{"role": "system", "content": "Be brief."}]}',
    b'{"id": "empty", "messages": [{"role": "user", "content": "   "}]}',
    b'{"id": "types", "messages": [{"role": "user", "content": 42}]}',
    b'{"id": "role", "messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"id": "ok-1", "prompt": "a duplicate id"}',
    b'{"id": "ok-2", "conversations": [{"from": "system", "value": "Be kind."}, '
    b'{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "old answer"}]}',
    b'{"id": "ok-3", "prompt": "Explain rain."}',
]


def test_bad_rows_are_reported_and_good_rows_committed(pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(BAD_ROWS) + b"\n")
    result = pipeline.cli("enqueue", "--input", str(src), "--run", "bad", "--shard-size", "2",
                          "--max-new-tokens", "64")
    assert result.returncode == 3, result.stderr
    reported = {int(line.split()[1].rstrip(":")) for line in result.stdout.splitlines()
                if line.strip().startswith("line ")}
    assert reported == {2, 3, 4, 5, 6, 7, 8}
    for needle in ("invalid JSON", "invalid UTF-8", "no user message", "empty user message",
                   "must be a string", "unknown role 'wizard'", "duplicate id 'ok-1'"):
        assert needle in result.stdout, needle
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    rejected = [json.loads(line) for k in storage.list("runs/bad/rejected/input/")
                for line in storage.get(k).decode().splitlines()]
    assert sorted(r["line"] for r in rejected) == [2, 3, 4, 5, 6, 7, 8]
    assert all(r["reason"] for r in rejected)

    pipeline.start_worker("w")
    pipeline.wait_done("bad")
    samples = {s["id"]: s for s in _committed_samples(pipeline.env["DFLASH_STORAGE"], "bad")}
    assert set(samples) == {"ok-1", "ok-2", "ok-3"}
    roles = [m["role"] for m in samples["ok-2"]["messages"]]
    assert roles == ["system", "user", "assistant"]
    assert samples["ok-2"]["messages"][2]["content"] != "old answer"
    assert pipeline.status("bad")["samples"]["input_rejected"] == 7


def test_redis_killed_and_restarted_while_shards_queued(
        pipeline: Pipeline, redis_server: RedisServer, tmp_path) -> None:  # noqa: ANN001
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(16))
    pipeline.cli("enqueue", "--input", src, "--run", "rr", "--shard-size", "4",
                 "--max-new-tokens", "64", check=True)
    pipeline.start_worker("w")
    storage_url = pipeline.env["DFLASH_STORAGE"]
    wait_until(lambda: _commits(storage_url, "rr"), 300, "a first commit")
    assert _queue_len(redis_server) >= 1, "no shard left queued to survive the restart"
    redis_server.kill()
    redis_server.start()
    wait_until(lambda: len(_commits(storage_url, "rr")) == 4, 300, "all shards after restart")
    assert pipeline.status("rr")["state"] == "done"


def test_reused_run_id_with_other_config_is_refused(pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(3))
    pipeline.cli("enqueue", "--input", src, "--run", "cfg", "--max-new-tokens", "64", check=True)
    result = pipeline.cli("enqueue", "--input", src, "--run", "cfg", "--max-new-tokens", "65",
                          "--shard-size", "2")
    assert result.returncode == 4
    assert "sampling.max_new_tokens" in result.stderr and "shard_size" in result.stderr
    assert "run.json" in result.stderr


def test_s3_bucket_missing_is_a_clear_error(pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(1))
    env_storage = "s3://no-such-bucket-here/x"
    pipeline.env["DFLASH_STORAGE"] = env_storage
    result = pipeline.cli("enqueue", "--input", src, "--run", "nb")
    assert result.returncode == 1
    assert "no-such-bucket-here" in result.stderr
    assert boto3.client("s3").list_buckets()["Buckets"]


def test_sigterm_flushes_and_requeues_the_shard(pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    rows = _mt_bench_rows(24)
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    kept = _interrupt_mid_shard(pipeline, src, "term", 24, signal.SIGTERM)
    storage_url = pipeline.env["DFLASH_STORAGE"]
    pipeline.start_worker("second")  # no resume: the stopping worker requeued the shard itself
    pipeline.wait_done("term")
    samples = _committed_samples(storage_url, "term")
    assert pipeline_requests(pipeline, "term", "second@") == sum(
        sent_requests(s) for s in samples if s["id"] not in kept)
    ids = [s["id"] for s in samples]
    assert sorted(ids) == sorted(str(r["question_id"]) for r in rows)


def test_redelivery_cap_parks_a_shard_and_resume_unparks_it(
        pipeline: Pipeline, tmp_path) -> None:  # noqa: ANN001
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(16))
    _interrupt_mid_shard(pipeline, src, "cap", 16, signal.SIGKILL, DFLASH_MAX_DELIVERIES="1")
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])

    # Queued again before a worker runs: once the new worker parks the shard (its reconciler
    # may heal it first), a later resume would be the user's retry and unpark it.
    pipeline.cli("resume", "--run", "cap", check=True)
    pipeline.start_worker("strict", DFLASH_MAX_DELIVERIES="1")
    wait_until(lambda: pipeline.state("cap") == "failed", 120, "the shard to be parked")
    status = pipeline.status("cap")
    assert status["shards"]["parked"] == 1
    assert "without committing" in status["parked"][0]["reason"]
    assert list(storage.list("runs/cap/failed/")), "the parking reason is kept in storage"

    report = json.loads(pipeline.cli("resume", "--run", "cap", "--json", check=True).stdout)
    assert report["enqueued"] == 1
    pipeline.wait_done("cap")
    assert pipeline.status("cap")["shards"]["parked"] == 0


def test_worker_without_its_model_exits_with_the_reason(pipeline: Pipeline) -> None:
    log = pipeline.log_dir / "nomodel.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker", "generate"],
            env={**pipeline.env, "DFLASH_MODEL": "/no/such/model"}, stdout=fh,
            stderr=subprocess.STDOUT,
        )
    assert proc.wait(timeout=120) != 0
    assert "/no/such/model" in log.read_text()

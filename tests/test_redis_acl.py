"""The stack's Redis users (docker/redis/redis.conf, started by docker/redis/start.sh as compose
does): a real redis-server with one ACL user per role. A run goes end to end with every process
on its own user (the producer enqueues and resumes, a generate, a hidden and a train worker take
their queues, Flower inspects the workers and the queues, ``status`` and the dashboard read) and
Redis denies none of them a command (its ACL LOG stays empty); what a role may not do, it is
refused; a password never appears on a command line; a placeholder password stops Redis."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from producer.demo import free_port
from tests.conftest import ROOT, Pipeline, wait_until

START = ROOT / "docker" / "redis" / "start.sh"
CONF = ROOT / "docker" / "redis" / "redis.conf"
USERS = ("default", "producer", "generate", "hidden", "train", "flower", "reader")


def variable(user: str) -> str:
    return "REDIS_PASSWORD" if user == "default" else f"REDIS_{user.upper()}_PASSWORD"


@dataclass
class AclRedis:
    """redis-server as compose starts it (start.sh, the stack's redis.conf), restartable on its
    data directory."""

    tmp: Path
    passwords: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def url(self, user: str) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), decode_responses=True)

    def denials(self) -> list[dict]:
        """What Redis refused since it started (its ACL LOG)."""
        return self.client("default").acl_log(count=1000)

    def start(self) -> None:
        data, log = self.tmp / "redis", self.tmp / "redis.log"
        data.mkdir(exist_ok=True)
        env = {"PATH": os.environ["PATH"], "REDIS_CONF_OUT": str(self.tmp / "redis.conf"),
               **{variable(u): p for u, p in self.passwords.items() if u != "flower"}}
        (self.tmp / "flower.pw").write_text(self.passwords["flower"])   # as a compose secret
        env["REDIS_FLOWER_PASSWORD_FILE"] = str(self.tmp / "flower.pw")
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                ["sh", str(START), str(CONF), "--port", str(self.port), "--bind", "127.0.0.1",
                 "--appendfsync", "always"], cwd=data, env=env, stdout=fh,
                stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc.poll() is None, log.read_text()
            try:
                return bool(self.client("default").ping())
            except redis.ConnectionError:
                return False

        wait_until(up, 20, "redis-server to accept connections")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[AclRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = AclRedis(tmp_path, {user: secrets.token_hex(12) for user in USERS})
    server.start()
    yield server
    server.stop()


def test_transactions_survive_a_restart(acl_redis: AclRedis) -> None:
    """Redis replays its AOF as the default user and re-checks its permissions at each EXEC:
    with that user disabled, every MULTI/EXEC (a shard's queued marker, kombu's acks) would be
    dropped on restart (redis/redis#14541). The default user is the administrator instead."""
    generate = acl_redis.client("generate")
    pipe = generate.pipeline(transaction=True)
    pipe.hset("dflash:r:generate:queued", "shard-000000", "queued 1.0")
    pipe.sadd("dflash:runs", "r")
    pipe.execute()
    generate.lpush("dflash:r:pauses", "x")
    acl_redis.stop()   # kill -9: appendfsync always has written both
    acl_redis.start()
    reader = acl_redis.client("reader")
    assert reader.hgetall("dflash:r:generate:queued") == {"shard-000000": "queued 1.0"}
    assert reader.smembers("dflash:runs") == {"r"}
    assert reader.lrange("dflash:r:pauses", 0, -1) == ["x"]
    assert "NOPERM" not in (acl_redis.tmp / "redis.log").read_text()


def test_each_role_is_refused_what_it_may_not_do(acl_redis: AclRedis, tmp_path: Path) -> None:
    cmdline = Path(f"/proc/{acl_redis.proc.pid}/cmdline").read_bytes().decode()
    assert cmdline.startswith("redis-server") and not any(
        p in cmdline for p in acl_redis.passwords.values()), cmdline
    conf = (tmp_path / "redis.conf")
    assert oct(conf.stat().st_mode & 0o777) == "0o600"
    assert not any(p in conf.read_text() for p in acl_redis.passwords.values())
    anonymous = redis.Redis(port=acl_redis.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(acl_redis.url("reader").replace(
            acl_redis.passwords["reader"], "wrong")).ping()
    admin = acl_redis.client("default")
    admin.lpush("dflash:r:pauses", "x")
    assert admin.config_get("appendonly") == {"appendonly": "yes"}
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}

    def refused(user: str, *command: str) -> bool:
        try:
            acl_redis.client(user).execute_command(*command)
        except redis.exceptions.NoPermissionError:
            return True
        return False

    reader = acl_redis.client("reader")
    assert reader.lindex("dflash:r:pauses", 0) == "x" and reader.llen("generate") == 0
    for command in (("LPUSH", "dflash:r:pauses", "y"), ("DEL", "dflash:r:pauses"),
                    ("LPUSH", "generate", "m"), ("PUBLISH", "/0.celeryev/x", "m"),
                    ("HSET", "dflash:r:generate:queued", "shard-000000", "x"),
                    ("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*")):
        assert refused("reader", *command), command
    for user, own, other in (("generate", "generate", "train"), ("hidden", "hidden", "train"),
                             ("train", "train", "generate")):
        client = acl_redis.client(user)
        assert client.lpush(other, "m") and client.lpush(own, "m")   # hand-off, requeue
        assert client.rpop(own) == "m"
        assert refused(user, "RPOP", other) and refused(user, "BRPOP", other, "1")
        assert refused(user, "DEL", other)
        assert refused(user, "HSET", f"dflash:r:{other}:attempts", "shard-000000", "1")
        assert refused(user, "HSET", f"dflash:r:{other}:parked", "shard-000000", "x")
        assert not refused(user, "HSET", f"dflash:r:{other}:queued", "shard-000000", "x")
        assert refused(user, "FLUSHDB") and refused(user, "CONFIG", "SET", "appendonly", "no")
    assert refused("hidden", "LPUSH", "dflash:r:pauses", "x")   # the gates are generate's
    assert refused("generate", "DEL", "dflash:r:pauses")   # and only the producer lifts a pause
    assert refused("generate", "SET", "dflash:r:lifted", "1")
    assert not refused("producer", "SET", "dflash:r:lifted", "0")
    assert refused("flower", "LLEN", "dflash:r:pauses") and refused("flower", "RPOP", "generate")
    assert refused("producer", "RPOP", "generate")   # it sends tasks, it never takes one
    assert acl_redis.client("producer").lpush("generate", "m")
    # Each refusal is in the ACL LOG, which the end-to-end test reads as "nothing refused".
    assert {d["username"] for d in acl_redis.denials()} == set(USERS) - {"default"}


@pytest.mark.parametrize("value", ["", "change-me-redis-train"])
def test_a_missing_or_placeholder_password_stops_redis_with_one_line(
        tmp_path: Path, value: str) -> None:
    env = {"PATH": os.environ["PATH"], "REDIS_CONF_OUT": str(tmp_path / "redis.conf"),
           **{variable(u): secrets.token_hex(8) for u in USERS}, "REDIS_TRAIN_PASSWORD": value}
    done = subprocess.run(["sh", str(START), str(CONF), "--port", str(free_port())], env=env,
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: REDIS_TRAIN_PASSWORD"), lines
    assert ("placeholder" in lines[0]) == bool(value), lines


@pytest.mark.e2e
def test_a_run_goes_end_to_end_with_every_process_on_its_own_user(
        acl_redis: AclRedis, tmp_path: Path, model_cache: Path) -> None:
    from common.runs.checkpoints import read_ledger
    from common.storage import open_storage
    from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
    from tests.test_train_e2e import TRAIN_ENV
    from tests.ui_support import running_ui

    storage = str(tmp_path / "storage")
    env = {**os.environ, "DFLASH_STORAGE": storage, "DFLASH_CACHE_DIR": str(model_cache),
           "DFLASH_LEASE_TTL": "4", "DFLASH_PART_SAMPLES": "4", "DFLASH_BATCH_SIZE": "4",
           "DFLASH_RETRY_BACKOFF_MAX": "2", "PYTHONUNBUFFERED": "1",
           "DFLASH_BROKER_URL": acl_redis.url("producer")}
    (tmp_path / "logs").mkdir()
    pipeline = Pipeline(env=env, log_dir=tmp_path / "logs")
    as_user = {user: {"DFLASH_BROKER_URL": acl_redis.url(user)} for user in USERS}
    flower_port = free_port()
    try:
        pipeline.start_worker("gen", **as_user["generate"])
        pipeline.start_worker("trainer", kind="train", **{**TRAIN_ENV, **as_user["train"]})
        pipeline.start_worker("hid", kind="hidden", **as_user["hidden"])
        flower_log = tmp_path / "logs" / "flower.log"
        with open(flower_log, "wb") as fh:
            flower = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "common.queue.celery_app", "flower",
                 f"--port={flower_port}", "--address=127.0.0.1"],
                env={**env, **as_user["flower"], "FLOWER_UNAUTHENTICATED_API": "true"},
                cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        pipeline.workers.append(flower)
        src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(8))
        pipeline.cli("enqueue", "--input", src, "--run", "acl", "--shard-size", "4", "--mode",
                     "online", "--epochs", "1", "--max-new-tokens", "48", "--heldout-min", "2",
                     check=True)
        pipeline.cli("enqueue", "--input", src, "--run", "acl-off", "--shard-size", "4",
                     "--limit", "4", "--epochs", "1", "--max-new-tokens", "48",
                     "--heldout-min", "0", check=True)
        reader = {**env, **as_user["reader"]}

        def status(run: str) -> dict:
            done = subprocess.run([sys.executable, "-m", "producer.cli", "status", "--run", run,
                                   "--json"], env=reader, capture_output=True, text=True,
                                  cwd=ROOT, timeout=120)
            assert done.returncode == 0 and done.stderr == "", done.stderr
            return json.loads(done.stdout)

        def finished() -> dict | None:
            """The online run trained to its schedule's end, the offline one's shard trained."""
            online = status("acl")
            down = online["downstream"]
            trained = read_ledger(open_storage(storage), "acl-off").done == [0]
            return online if (online["state"] == "done" and down.get("finished") == "schedule"
                              and down["committed"] == online["shards"]["total"]
                              and trained) else None

        online = wait_until(finished, 600, "both runs to finish", interval=2)
        assert online["samples"]["done"] == 8 and online["shards"]["parked"] == 0, online
        assert online["redis"] == {"reachable": True, "monitor_ready": True}, online["redis"]
        offline = status("acl-off")
        assert offline["state"] == "done" and offline["downstream"]["committed"] == 1, offline

        def flower_get(path: str) -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{flower_port}{path}",
                                        timeout=30) as response:
                return json.loads(response.read())

        workers = wait_until(lambda: flower_get("/api/workers?refresh=1") or None, 60,
                             "Flower to inspect the workers")
        assert {name.split("@")[0] for name in workers} >= {"gen", "trainer", "hid"}, workers
        queues = flower_get("/api/queues/length")["active_queues"]
        assert {q["name"] for q in queues} >= {"generate", "train"}, queues
        with running_ui(reader, tmp_path / "ui.log") as ui:
            api = ui.json("/api/runs/acl/status")
            assert api["state"] == "done" and api["samples"] == online["samples"]
        resumed = pipeline.cli("resume", "--run", "acl", "--json", check=True)
        assert json.loads(resumed.stdout)["enqueued"] == 0
    finally:
        pipeline.stop_all()
    denied = acl_redis.denials()
    assert denied == [], json.dumps(denied, indent=1)[:4000]

"""Gates fail closed and only the producer's role lifts a pause (issue 65, point 4): in storage a
pause record that does not read is still a pause, in Redis the generate user may only add pause
events (its ACL refuses every other write to them and to the producer's lift count)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis

from common import keys
from common.errors import RunPaused
from common.gates.judge import GateConfig
from common.monitor.run_monitor import gate_events, pause_from_storage, resume_gates
from common.queue import redis_keys
from common.queue.reconcile import plan_run
from common.reads import foreign_counts, forget_foreign
from common.storage import LocalStorage, Storage, open_storage
from producer.status import StatusReader
from tests import test_redis_acl, test_run_summary
from tests.conftest import wait_until
from tests.test_redis_acl import AclRedis
from workers.generate.monitor import RunMonitor

acl_redis = test_redis_acl.acl_redis
run = test_run_summary.run   # a run of 6 shards (paused and resumed once), written once

RUN = "g"
GATES = GateConfig(pause_after=10)
RESUME = {"accepted": True, "checked": 1, "max_reject_rate": 0.5, "pause_after": 10}
HOSTILE = {"empty": b"{}", "garbage": b"\x00 not json", "list": b"[1, 2]",
           "deep": b'{"s":"\\ud800","reason":"r","a":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
           "nan": b'{"reason": "r", "at": NaN}'}


class Store:
    """A storage backend on which a key may overwrite an object (MinIO has no put-once policy),
    each write later in the storage's own time than the one before."""

    def __init__(self, backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.backend, self.clock = backend, 1_000_000.0
        url = (request.getfixturevalue("s3_storage") if backend == "s3"
               else str(tmp_path / "storage"))
        self.storage: Storage = open_storage(url)
        self.bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.prefix, self.last = prefix + "/", 0.0

    def write(self, key: str, body: bytes) -> None:
        """Put ``body`` at ``key``, over an object already there."""
        if self.backend == "s3":   # LastModified: the S3 server's own clock (written again
            wait_until(lambda: self._put_later(key, body), 30,   # within one tick of it)
                       f"{key} written later than the write before it")
            return
        assert isinstance(self.storage, LocalStorage)
        path = self.storage.path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        self.clock += 10
        os.utime(path, (self.clock, self.clock))

    def _put_later(self, key: str, body: bytes) -> bool:
        boto3.client("s3").put_object(Bucket=self.bucket, Key=self.prefix + key, Body=body)
        modified = next(o.modified for o in self.storage.list_objects(key) if o.key == key)
        if modified > self.last:
            self.last = modified
            return True
        return False


@pytest.mark.parametrize("body", HOSTILE.values(), ids=list(HOSTILE))
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_an_overwritten_pause_is_still_a_pause_and_only_a_resume_lifts_it(
        backend: str, body: bytes, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    forget_foreign()
    store = Store(backend, tmp_path, request)
    pause_key = keys.gate_event(RUN, "pause", "20250101T000000.000001-aaaaaa")
    store.write(pause_key, json.dumps({"reason": "real", "at": 1.0}).encode())
    assert pause_from_storage(store.storage, RUN) == {"reason": "real", "at": 1.0}
    store.write(pause_key, body)   # the generate key overwrites its last pause
    pause = pause_from_storage(store.storage, RUN)
    assert pause is not None and pause["reason"].startswith("unreadable pause record"), pause
    # A forged resume (not a resume record) lifts nothing; it is noted.
    store.write(keys.gate_event(RUN, "resume", "20250101T000000.000002-bbbbbb"),
                json.dumps({**RESUME, "accepted": "yes"}).encode())
    assert pause_from_storage(store.storage, RUN) == pause
    assert [kind for kind, _ in gate_events(store.storage, RUN)] == ["pause"]
    assert foreign_counts() == {"gates": 2}
    # The producer's resume lifts it; an unreadable pause written after it pauses again.
    store.write(keys.gate_event(RUN, "resume", "20250101T000000.000003-cccccc"),
                json.dumps(RESUME).encode())
    assert pause_from_storage(store.storage, RUN) is None
    store.write(keys.gate_event(RUN, "pause", "00000000T000000.000000-000000"), body)
    again = pause_from_storage(store.storage, RUN)
    assert again is not None and again["reason"].startswith("unreadable pause record")


def refused(client: redis.Redis, *command: str) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def attempts(run_id: str) -> list[tuple[str, ...]]:
    """Every way a write could remove, rewrite or hide the run's pause events or lift count."""
    pauses, lifted = redis_keys.RunKeys(run_id).pauses, redis_keys.RunKeys(run_id).lifted
    own = redis_keys.RunKeys(run_id).gates   # a key the generate user may write
    return [("DEL", pauses), ("UNLINK", pauses), ("RENAME", pauses, f"{own}:x"),
            ("RENAMENX", pauses, "generate-x"), ("SET", pauses, "x"), ("EXPIRE", pauses, "1"),
            ("PEXPIREAT", pauses, "1"), ("LTRIM", pauses, "1", "0"), ("LPOP", pauses),
            ("RPOP", pauses), ("LREM", pauses, "0", "x"), ("LSET", pauses, "0", "{}"),
            ("LMOVE", pauses, "generate", "LEFT", "LEFT"), ("RPOPLPUSH", pauses, "generate"),
            ("RPUSH", pauses, "{}"), ("COPY", own, pauses, "REPLACE"),
            ("SORT", "generate", "ALPHA", "STORE", pauses), ("MOVE", pauses, "1"),
            ("XADD", pauses, "MAXLEN", "0", "*", "record", "{}"), ("XTRIM", pauses, "MAXLEN", "0"),
            ("SET", lifted, "99"), ("INCR", lifted), ("DEL", lifted), ("COPY", own, lifted),
            ("RENAME", own, lifted), ("EVAL", "return redis.call('DEL', KEYS[1])", "1", pauses),
            ("EVAL", "return redis.call('SET', KEYS[1], '9')", "1", lifted),
            ("FLUSHDB",), ("FLUSHALL",), ("SWAPDB", "0", "1")]


def attempt_everything(generate: redis.Redis, run_id: str, paused: Any) -> None:
    """Each attempt is refused and the run still reads paused after it."""
    reason = paused()["reason"]
    for command in attempts(run_id):
        assert refused(generate, *command), command
        assert (paused() or {}).get("reason") == reason, command
    pipe = generate.pipeline(transaction=True)   # nor inside a transaction
    pipe.delete(redis_keys.RunKeys(run_id).pauses)
    pipe.set(redis_keys.RunKeys(run_id).lifted, 99)
    with pytest.raises(redis.RedisError):
        pipe.execute()
    assert paused()["reason"] == reason


def test_the_generate_user_cannot_lift_a_pause_in_redis(acl_redis: AclRedis,
                                                        tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "storage"))
    generate, producer = acl_redis.client("generate"), acl_redis.client("producer")
    monitor = RunMonitor(generate, storage, RUN, GATES)
    monitor.ensure_ready()   # the rebuild, as the generate user, needs no write on the pause
    pause = monitor.pause("the gates tripped")
    assert monitor.paused() == pause and monitor.pause("a second one") == pause   # one pause
    assert generate.llen(redis_keys.RunKeys(RUN).pauses) == 1
    attempt_everything(generate, RUN, monitor.paused)
    with pytest.raises(RunPaused):
        monitor.check()
    lifted = resume_gates(producer, storage, RUN, GATES, accept=True)
    assert lifted is not None and lifted["lifted"] == pause["reason"]
    assert monitor.paused() is None
    # What the generate user may write (a pause event, readable or not) only ever pauses.
    generate.lpush(redis_keys.RunKeys(RUN).pauses, "not json")
    assert monitor.paused()["reason"].startswith("unreadable pause record")
    resume_gates(producer, storage, RUN, GATES, accept=True)
    assert monitor.paused() is None
    # A lift count past the events (the list removed by someone with more rights) is a pause.
    acl_redis.client("default").delete(redis_keys.RunKeys(RUN).pauses)
    assert monitor.paused()["reason"].startswith("unreadable pause record (lifted at 2 of 0")
    resume_gates(producer, storage, RUN, GATES, accept=True)
    assert monitor.paused() is None and producer.get(redis_keys.RunKeys(RUN).lifted) == "0"
    assert {d["username"] for d in acl_redis.denials()} == {"generate"}


def test_a_worker_and_status_see_the_pause_after_the_generate_users_attempts(
        acl_redis: AclRedis, run: tuple[Any, Path], tmp_path: Path) -> None:
    shutil.copytree(run[1] / "storage", tmp_path / "s")
    storage = LocalStorage(str(tmp_path / "s"))
    name, gates = test_run_summary.RUN, test_run_summary.GATES
    generate, reader = acl_redis.client("generate"), acl_redis.client("reader")

    def status() -> dict[str, Any]:
        found = dict(StatusReader(storage, reader, name).read())
        json.dumps(found, allow_nan=False)   # as status --json prints it
        return found

    monitor = RunMonitor(generate, storage, name, gates)
    monitor.ensure_ready()   # the run was resumed: not paused
    assert status()["state"] != "paused" and not plan_run(storage, reader, name).paused
    pause = monitor.pause("the gates tripped")
    stored = [k for _, k in sorted((o.modified, o.key) for o in
                                   storage.list_objects(keys.gates_prefix(name)))][-1]
    (storage.path / stored).write_bytes(b"{}")   # the generate key overwrites it (MinIO)
    attempt_everything(generate, name, monitor.paused)
    with pytest.raises(RunPaused):
        monitor.check()
    seen = status()
    assert seen["state"] == "paused" and seen["pause"]["reason"] == pause["reason"]
    assert plan_run(storage, reader, name).paused
    # Redis lost: status reads storage, and a rebuild (as generate) takes the pause from it.
    acl_redis.client("default").flushall()
    assert status()["pause"]["reason"].startswith("unreadable pause record")
    monitor.ensure_ready()
    assert monitor.paused()["reason"].startswith("unreadable pause record")
    assert status()["state"] == "paused"
    resume_gates(acl_redis.client("producer"), storage, name, gates, accept=True)
    assert monitor.paused() is None and status()["state"] != "paused"
    assert not plan_run(storage, reader, name).paused

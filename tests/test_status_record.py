"""``status --json`` is what :class:`RunStatus` declares, nested parts too: every reading of a run
(Redis reachable and not, offline and online, paused, with engines, speculative figures and an
MTP choice announced) validates against the TypedDicts as printed, and no closed part holds a
field its type does not name (the trainer's metrics record is open: its extra fields pass)."""

from __future__ import annotations

import json
import shutil
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import TypeAdapter
from typing_extensions import is_typeddict  # the records' TypedDicts are typing_extensions'

from common import keys
from common.choices import MtpSource
from common.monitor.run_monitor import rebuild
from common.queue import redis_keys
from common.queue.celery_app import TRAIN
from common.storage import LocalStorage
from producer.commands import render_status
from producer.status import StatusReader
from producer.status_record import RunStatus, TrainFigures
from tests import test_run_summary
from tests.test_run_summary import GATES, RUN

run = test_run_summary.run  # a run of 6 shards of 16 rows, 0-2 committed, written once

OPEN = (TrainFigures,)   # the trainer adds figures over time: not a closed set of fields


def undeclared(value: object, kind: Any, where: str = "status") -> list[str]:
    """The paths of fields in ``value`` that its declared type ``kind`` does not name."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        found = [undeclared(value, arg, where) for arg in args
                 if isinstance(value, dict) == (is_typeddict(arg) or
                                                typing.get_origin(arg) is dict)]
        return min(found, key=len) if found else []
    if origin in (typing.NotRequired, typing.Required):
        return undeclared(value, args[0], where)
    if is_typeddict(kind) and isinstance(value, dict):
        hints = typing.get_type_hints(kind)
        extra = [] if kind in OPEN else [f"{where}.{k}" for k in value if k not in hints]
        return extra + [path for k, v in value.items() if k in hints
                        for path in undeclared(v, hints[k], f"{where}.{k}")]
    if origin is dict and isinstance(value, dict):
        return [path for k, v in value.items() for path in undeclared(v, args[1], f"{where}.{k}")]
    if origin is list and isinstance(value, list):
        return [path for i, v in enumerate(value)
                for path in undeclared(v, args[0], f"{where}[{i}]")]
    return []


def _printed(status: RunStatus) -> RunStatus:
    """What ``status --json`` prints, read back and validated (strict) against the type."""
    text = json.dumps(status, sort_keys=True, allow_nan=False)
    problems = undeclared(json.loads(text), RunStatus)
    assert not problems, f"fields no type names: {problems}"
    return TypeAdapter(RunStatus).validate_json(text, strict=True)


@pytest.fixture
def reading(run: Any, tmp_path: Path) -> tuple[Any, LocalStorage]:
    client, base = run
    shutil.copytree(base / "storage", tmp_path / "s")
    storage = LocalStorage(str(tmp_path / "s"))
    client.flushall()
    rebuild(client, storage, RUN, GATES)
    return client, storage


def _announce(client: Any) -> None:
    """What generate workers add to Redis as they run: an engine, figures, an MTP choice."""
    client.hset(redis_keys.redis_engines(), "host:0", json.dumps(
        {"url": "http://127.0.0.1:1", "log": "/tmp/e.log", "pid": 7, "worker": "w1",
         "algorithm": "EAGLE"}))
    client.hset(redis_keys.RunKeys(RUN).speculative, mapping={
        "algorithm:w1": "EAGLE", "verify_steps:w1": "10", "output_tokens:w1": "35",
        "verify_steps:w2": "many", "output_tokens:w2": "4"})   # w2's steps: no count (noted)
    client.hset(redis_keys.RunKeys(RUN).mtp, "w1", json.dumps(
        {"mtp": "on", "mode": "auto", "reason": "measured faster", "source": MtpSource.MEASURED,
         "rates": {"on": 12.5, "off": 10}}))


def test_an_offline_reading_is_its_type(reading: tuple[Any, LocalStorage]) -> None:
    client, storage = reading
    _announce(client)
    status = _printed(StatusReader(storage, client, RUN).read())
    assert status["redis"] == {"reachable": True, "monitor_ready": True}
    assert status["engines"] and status["engines"]["host:0"]["worker"] == "w1"
    assert status["speculative"] == {
        "w1": {"algorithm": "EAGLE", "verify_steps": 10, "output_tokens": 35,
               "accept_length": 3.5},
        "w2": {"algorithm": None, "verify_steps": 0, "output_tokens": 4, "accept_length": None}}
    assert status["mtp"] and status["mtp"]["w1"]["source"] is MtpSource.MEASURED
    assert status["mtp"]["w1"]["rates"] == {"on": 12.5, "off": 10.0}
    assert status["gates"]["window"] is not None and status["gates"]["turns"] is not None
    assert status["downstream"]["mode"] == "offline" and "train" not in status["downstream"]
    assert status["shards"]["committed"] == 3 and status["shards"]["running"] == 0


def test_a_paused_reading_is_its_type(reading: tuple[Any, LocalStorage]) -> None:
    client, storage = reading
    record = {"reason": "too many rejections", "at": 1.5, "checked": 40, "rejected": 30,
              "reasons": {"too_few_tokens": 30}, "examples": [
                  {"id": "1-1", "reasons": ["too_few_tokens"], "details": [], "answer": "a"}],
              "window": {"size": 24, "rejected": 20, "limit": 24, "rate": 0.8333,
                         "max_reject_rate": 0.5}}
    assert redis_keys.push_pause(client, RUN, record)
    status = _printed(StatusReader(storage, client, RUN).read())
    assert status["state"] == "paused" and status["reason"] == "too many rejections"
    assert status["pause"] == record
    assert "PAUSED  too many rejections" in render_status(status)


def test_a_reading_without_redis_is_its_type(reading: tuple[Any, LocalStorage]) -> None:
    _, storage = reading
    down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1,
                       decode_responses=True)
    status = _printed(StatusReader(storage, down, RUN, lease_ttl=30).read())
    assert status["redis"]["reachable"] is False
    assert (status["parked"], status["engines"], status["speculative"], status["mtp"]) == (
        None, None, None, None)
    assert status["shards"]["running"] is None and status["samples"]["in_progress"] == 13


def test_an_online_reading_is_its_type(reading: tuple[Any, LocalStorage]) -> None:
    client, storage = reading
    config = json.loads(storage.get(keys.run_config(RUN)))
    (Path(storage.root) / keys.run_config(RUN)).write_text(json.dumps({**config,
                                                                       "mode": "online"}))
    client.hset(TRAIN.keys(RUN).metrics, mapping={
        "step": "3", "epoch": "1", "lr": "0.001", "loss": "1.5", "ranks": "2", "hosts": "1",
        "slot_accuracy": "[0.5, null]", "tau": "1.7", "tau_step": "3", "memory_plan": "a plan",
        "eval_error": "boom", "eval_error_step": "2", "a_later_figure": "9"})
    status = _printed(StatusReader(storage, client, RUN).read())
    down = status["downstream"]
    assert down["mode"] == "online" and down.get("eval_error") == {"message": "boom", "step": 2}
    train = down.get("train")
    assert train is not None and train.get("slot_accuracy") == [0.5, None]
    assert (train.get("step"), train.get("lr"), down.get("tau")) == (3, 0.001, 1.7)
    assert "drafter eval failed at step 2" in render_status(status)

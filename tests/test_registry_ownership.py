"""Redis's hash and set commands are sent only by the registries in common/queue/: a caller
asks a registry for an operation (:class:`common.queue.shard_registry.ShardRegistry`,
:class:`common.queue.run_records.RunRecords`), it does not edit a registry's keys itself
(issue 68, point 4)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("common", "workers", "producer")
OWNER = "common/queue/"

HASH_AND_SET = frozenset({
    "hset", "hsetnx", "hmset", "hdel", "hget", "hmget", "hgetall", "hincrby", "hincrbyfloat",
    "hexists", "hkeys", "hvals", "hlen", "hscan", "hscan_iter", "hstrlen", "hrandfield",
    "sadd", "srem", "smembers", "sismember", "smismember", "scard", "spop", "srandmember",
    "smove", "sscan", "sscan_iter", "sinter", "sunion", "sdiff",
})

ALLOWED = {
    # The run monitor owns the quality gates' counters (RunKeys.gates, gate_hist, answers,
    # partial while it rebuilds): its counting, rebuild and resume are one registry each, kept
    # beside the gates whose arithmetic they are.
    "common/monitor/run_monitor.py": "the run monitor's counters: its own registry",
    "common/monitor/rebuild.py": "the run monitor's rebuild: one MULTI over its own counters",
    "workers/generate/monitor.py": "the run monitor's worker side: its counters and answers",
    # Readers that fetch many registries' keys in one pipeline round trip.
    "producer/status_live.py": "status reads every registry in one pipeline",
    "producer/ui/views.py": "the dashboard reads the monitor's histogram",
}


def _offenders() -> dict[str, list[str]]:
    """Per file outside common/queue/: the hash or set commands it calls, with their lines."""
    found: dict[str, list[str]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(OWNER):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in HASH_AND_SET):
                    found.setdefault(rel, []).append(f"{node.func.attr}@{node.lineno}")
    return found


def test_hash_and_set_commands_only_in_registries() -> None:
    stray = {rel: calls for rel, calls in _offenders().items() if rel not in ALLOWED}
    assert not stray, f"raw Redis hash/set commands outside common/queue/: {stray}"


def test_allow_list_has_no_stale_entry() -> None:
    """An allowed file that no longer sends such a command leaves the list."""
    found = _offenders()
    assert sorted(rel for rel in ALLOWED if rel not in found) == []


def test_the_scan_sees_the_registry() -> None:
    """The scan is live: the registry itself sends the commands it looks for."""
    source = (ROOT / OWNER / "shard_registry.py").read_text()
    calls = {n.func.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute)}
    assert {"hset", "hdel", "hincrby", "sadd"} <= calls & HASH_AND_SET


def test_the_registries_keys_are_the_strings_redis_acls_and_stored_state_name() -> None:
    """docker/redis/redis.conf's selectors and every Redis already running name these keys."""
    from common.queue.redis_keys import RunKeys, StageKeys

    run = RunKeys("r1")
    assert [run.partial, run.rate, run.requests, run.speculative, run.gates, run.gate_window,
            run.gate_hist, run.gate_examples("empty"), run.gate_rebuild, run.answers,
            run.answers_order, run.pauses, run.lifted, run.mtp] == [
        "dflash:r1:partial", "dflash:r1:rate", "dflash:r1:requests", "dflash:r1:speculative",
        "dflash:r1:gates", "dflash:r1:gates:window", "dflash:r1:gates:hist",
        "dflash:r1:gates:examples:empty", "dflash:r1:gates:rebuild", "dflash:r1:answers",
        "dflash:r1:answers:order", "dflash:r1:pauses", "dflash:r1:lifted",
        "dflash:r1:generate:mtp"]
    stage = StageKeys("r1", "hidden")
    assert [stage.queued, stage.running, stage.attempts, stage.parked, stage.metrics,
            stage.lease(3), stage.lease(None), stage.lease_pattern] == [
        "dflash:r1:hidden:queued", "dflash:r1:hidden:running", "dflash:r1:hidden:attempts",
        "dflash:r1:hidden:parked", "dflash:r1:hidden:metrics",
        "dflash:r1:hidden:lease:shard-000003", "dflash:r1:hidden:lease:run",
        "dflash:r1:hidden:lease:*"]

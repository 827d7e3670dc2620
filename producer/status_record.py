"""What ``status`` reads of a run, as one typed record: the text, ``--json`` and dashboard
renderers read these fields (``--json`` prints it as is, so its field names are the contract).

Nested parts whose shape belongs to another module (the gates' counters, the downstream stage,
Redis's live figures) stay plain objects; every top-level field is named and typed here.
"""

from __future__ import annotations

from typing import Any, TypedDict


class RedisView(TypedDict):
    reachable: bool
    monitor_ready: bool


class SampleCounts(TypedDict):
    total: int | None
    done: int
    in_progress: int
    rejected: int
    input_rejected: int
    gate_rejected: int


class TokenCounts(TypedDict):
    generated: int
    per_s: float | None


class RunStatus(TypedDict):
    """One ``status`` reading (``status --json``'s object)."""

    run: str
    state: str                       # a RunState's value
    storage: str
    model: str
    redis: RedisView
    shards: dict[str, Any]           # total, committed, running, queued, parked, ...
    samples: SampleCounts
    gates: dict[str, Any]            # checked, rejected, rate, reasons, ...
    pause: dict[str, Any] | None
    reason: str | None
    tokens: TokenCounts
    samples_per_s: float | None
    eta_s: float | None
    parked: list[Any] | None
    engines: dict[str, Any] | None
    speculative: dict[str, Any] | None   # per worker: its speculative algorithm and figures
    mtp: dict[str, Any] | None           # per worker: whether it generates through MTP, why
    downstream: dict[str, Any]       # the hidden stage's commits or the trainer's progress
    drafter: dict[str, Any] | None
    foreign_objects: dict[str, int]

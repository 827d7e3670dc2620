"""What each dashboard panel shows, as JSON: runs, status, series, shard grid, engines, gates,
the newest stored drafter eval.

Blocking reads (storage, Redis); the server runs them in threads. Readers are kept per run,
so what never changes (commits, parts, checkpoints) is read once per dashboard process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from common import keys
from common.choices import Stage
from common.errors import NotFound, RunNotFound
from common.monitor.run_monitor import examples_of
from common.queue import redis_keys
from common.queue.redis_values import count_of, field_key
from common.runs.evals import newest_eval
from common.runs.index import RunIndex
from common.runs.schemas import GateExample
from common.runs.store import RunStore
from common.storage import Storage
from producer.report import token_stats
from producer.report_evals import bars, drafter_label
from producer.status import StatusReader
from producer.status_record import RunStatus
from producer.ui.gate_source import GateSource
from producer.ui.series import SeriesReader

log = logging.getLogger(__name__)

RUNS_TTL_S = 15.0
STATUS_REUSE_S = 1.0


def resume_command(run: str) -> str:
    """The exact command that lifts a quality-gate pause (as ``status`` prints it)."""
    return f"dflash-pipeline resume --run {run} --accept-gates"


@dataclass
class RunView:
    """One run's readers; a lock keeps two refreshes from reading the same parts twice."""

    status: StatusReader
    series: SeriesReader
    gate_source: GateSource
    lock: threading.Lock = field(default_factory=threading.Lock)
    last: tuple[float, RunStatus] | None = None


@dataclass
class Views:
    storage: Storage
    client: redis.Redis
    runs: dict[str, RunView] = field(default_factory=dict)
    _listed: tuple[float, list[str]] = (0.0, [])
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def view(self, run: str) -> RunView:
        if not keys.valid_run_id(run):
            raise RunNotFound(f"invalid run id {run!r}")
        with self._lock:
            if run not in self.runs:
                index = RunIndex(self.storage, run, rejected=True)  # one digest cache per run
                self.runs[run] = RunView(StatusReader(self.storage, self.client, run, index=index),
                                         SeriesReader(self.storage, run, index=index),
                                         GateSource(self.storage, run))
            return self.runs[run]

    def run_ids(self) -> list[str]:
        """Runs with a run.json in storage (listed again at most every RUNS_TTL_S)."""
        at, ids = self._listed
        if time.monotonic() - at > RUNS_TTL_S or not ids:
            ids = sorted({found.run for key in self.storage.list("runs/")
                          if (found := keys.parse(key)) is not None
                          and found.kind is keys.KeyKind.RUN_CONFIG})
            self._listed = (time.monotonic(), ids)
        return ids

    def run_list(self) -> list[dict[str, Any]]:
        """The index page: every run's state, progress and age; a run that cannot be read is
        one row with its error, and every other run reads normally."""
        out = []
        for run in self.run_ids():
            try:
                out.append(self._run_row(run))
            except (NotFound, RunNotFound):
                continue
            except Exception as exc:  # one run's failure (a forged object, a bug) is its row
                log.warning("run %s: not shown in the run list: %s: %s", run,
                            type(exc).__name__, exc)
                out.append({"run": run, "state": "unreadable",
                            "error": f"{type(exc).__name__}: {exc}"[:300]})
        return out

    def _run_row(self, run: str) -> dict[str, Any]:
        status = self.status(run)
        config = RunStore(self.storage, run).config()
        samples, shards = status["samples"], status["shards"]
        return {"run": run, "state": status["state"], "model": status["model"],
                "samples_done": samples["done"], "samples_total": samples["total"],
                "in_progress": samples["in_progress"],
                "shards_committed": shards["committed"], "shards_total": shards["total"],
                "created_at": config.created_at,
                "age_s": round(time.time() - config.created_at, 1),
                "eta_s": status["eta_s"], "tokens_per_s": status["tokens"]["per_s"]}

    def status(self, run: str, reuse_s: float = 0.0) -> RunStatus:
        """Exactly what ``dflash-pipeline status --run RUN --json`` prints; ``reuse_s``: a read
        at most that old will do (the other panels of one refresh share one read)."""
        view = self.view(run)
        with view.lock:
            if reuse_s and view.last and time.monotonic() - view.last[0] < reuse_s:
                return view.last[1]
            status = view.status.read()
            view.last = (time.monotonic(), status)
            return status

    def recent_status(self, run: str) -> RunStatus:
        return self.status(run, STATUS_REUSE_S)

    def series(self, run: str, live: bool = False) -> dict[str, Any]:
        """The run's series from its commits; ``live``: with its uncommitted parts, capped."""
        view = self.view(run)
        with view.lock:
            if view.status.storage.exists(keys.run_config(run)):
                return view.series.read(live)
        raise RunStore(self.storage, run).missing()

    def shards(self, run: str) -> dict[str, Any]:
        """Every generate shard's state for the grid, from the same read as ``status``:
        committed, running, healing, retrying, pending or parked (unknown without Redis)."""
        status = self.recent_status(run)
        view = self.view(run)
        parked = {p["shard"]: p["reason"] for p in status["parked"] or []
                  if p["stage"] == Stage.GENERATE}
        with view.lock:
            grid = [{"shard": shard, "state": state, "reason": parked.get(shard)}
                    for shard, state in sorted(view.status.grid.items())]
        return {"run": run, "shards": grid, "redis": status["redis"]["reachable"]}

    def gates(self, run: str) -> dict[str, Any]:
        """The supervised-token histogram, examples per reason and rolling window: the live run
        monitor's (Redis), else the same figures rebuilt from storage; ``source`` says which."""
        status = self.recent_status(run)
        config = RunStore(self.storage, run).config()
        hist: Counter[int] = Counter()
        examples: dict[str, list[GateExample]] = {}
        window, source, reachable = status["gates"]["window"], "live", True
        try:
            if status["redis"]["monitor_ready"]:
                hist.update(histogram(redis_keys.RunKeys(run).gate_hist,
                                      self.client.hgetall(redis_keys.RunKeys(run).gate_hist)))
                for reason in status["gates"]["reasons"]:
                    key = redis_keys.RunKeys(run).gate_examples(reason)
                    examples[reason] = examples_of(key, self.client.lrange(key, 0, 2))
            else:
                reachable, source = status["redis"]["reachable"], "storage"
        except redis.RedisError:
            reachable, source = False, "storage"
        if source == "storage":
            stored = self.view(run).gate_source.read(config.gates)
            hist, examples, window = stored.histogram, stored.examples, stored.window
        return {"run": run, "redis": reachable, "source": source,
                "supervised_tokens": token_stats(hist), "window": window,
                "min_supervised_tokens": config.gates.min_supervised_tokens,
                "max_reject_rate": config.gates.max_reject_rate,
                "pause_after": config.gates.pause_after, "examples": examples,
                "resume_command": resume_command(run)}


    def evals(self, run: str) -> dict[str, Any]:
        """The newest stored ``eval-drafter --dataset`` table (as ``report`` shows it), its bars
        (tau per set, speedup per concurrency) and the stored records passed over (foreign)."""
        if not self.storage.exists(keys.run_config(run)):
            raise RunStore(self.storage, run).missing()
        found = newest_eval(self.storage, run) or {"key": None, "record": None, "skipped": []}
        record = found["record"]
        return {"run": run, "key": found["key"], "record": record,
                "drafter": drafter_label(record) if record else None,
                "bars": bars(record) if record else [], "skipped": found["skipped"]}


def histogram(key: str, found: dict[Any, Any]) -> dict[int, int]:
    """The supervised-token histogram (a Redis hash, tokens -> samples): a field or value that
    is no count is noted and left out."""
    counts = {}
    for tokens, value in found.items():
        where = field_key(key, str(tokens))
        bucket, count = count_of(where, tokens, -1), count_of(where, value, -1)
        if bucket >= 0 and count >= 0:
            counts[bucket] = count
    return counts

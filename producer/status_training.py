"""The trainer's progress as ``status`` shows it (online runs): the live metrics record (Redis),
else the newest checkpoint's, with the ledger's epoch, schedule and counters from storage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from common.queue.celery_app import TRAIN
from common.queue.redis_values import count_of, field_key, number_of
from common.reads import value_or_none
from common.runs.checkpoints import Ledger, latest_metrics, read_ledger
from common.runs.schemas import METRIC_LIST
from common.storage import Storage
from producer.status_record import Downstream, EvalError, TrainFigures


def training_status(storage: Storage, run: str, epochs: int, live: Mapping[str, str] | None,
                    parked: int | None) -> Downstream:
    """``downstream`` of an online run (``live``: the trainer's Redis record, None: Redis down;
    ``parked``: the train stage's parked shards, None: Redis down)."""
    record: dict[str, object] = dict(live) if live is not None else {}
    if not record:   # Redis lost its record: the newest checkpoint's metrics
        record = dict(latest_metrics(storage, run))
    ledger = read_ledger(storage, run)
    metrics = TRAIN.keys(run).metrics
    # The trainer's record is open (figures it adds pass through to --json): its known fields
    # are named in TrainFigures, as text (Redis) or numbers (a checkpoint's metrics).
    train = cast(TrainFigures, record)
    train.update(training_progress(record, ledger, epochs, metrics))
    # Steps retried out of memory: the live count, else the newest checkpoint's.
    train["oom_retries"] = _count(record.get("oom_retries"), ledger.oom_retries)
    # Lists arrive as JSON text from Redis (read as any Redis value), as lists from a checkpoint.
    if isinstance(text := record.get("slot_accuracy"), str):
        train["slot_accuracy"] = value_or_none(f"{metrics}:slot_accuracy", text, METRIC_LIST)
    if isinstance(text := record.get("tau_per_position"), str):
        train["tau_per_position"] = value_or_none(f"{metrics}:tau_per_position", text,
                                                  METRIC_LIST)
    # The periodic eval's last failure, until an eval succeeds (training went on).
    message, at = train.get("eval_error"), train.get("eval_error_step")
    error = (EvalError(message=message, step=count_of(field_key(metrics, "eval_error_step"), at))
             if message and at else None)
    tau_step = train.get("tau_step")
    return {"mode": "online", "stage": "train", "parked": parked,
            "committed": len(ledger.done), "train": train,
            "rows_set_aside": ledger.set_aside_counts(),
            "memory_plan": train.get("memory_plan") or None,
            "finished": ledger.finished or None,
            "tau": number_of(field_key(metrics, "tau"), train.get("tau")),
            "tau_step": count_of(field_key(metrics, "tau_step"), tau_step) if tau_step else None,
            "eval_error": error}


def training_progress(train: Mapping[str, object], ledger: Ledger, epochs: int,
                      key: str = "train metrics") -> TrainFigures:
    """The trainer's epoch, schedule and learning rate as numbers: the ledger (storage) for
    what it holds, the live metrics record (``key``: where it was read) for the rest
    (``status --json`` contract); a value that is no finite number is noted and absent."""
    def number(name: str) -> float | None:
        return number_of(field_key(key, name), train.get(name))

    def whole(name: str) -> int | None:
        value = number(name)
        return int(value) if value is not None else None

    return {"epoch": whole("epoch") or min(ledger.epoch + 1, epochs), "epochs": epochs,
            "step": whole("step"),
            "total_steps": whole("total_steps") or ledger.total_steps or None,
            "lr": number("lr"), "eta_s": number("eta_s"),
            "tau_by_epoch": list(ledger.tau_by_epoch),
            "finished": ledger.finished or None,
            # An epoch's hours: the plan's (None on the CPU) and the measured steps' pace.
            "epoch_hours_planned": number("epoch_hours_planned"),
            "epoch_hours_measured": number("epoch_hours_measured")}


def _count(value: object, fallback: int) -> int:
    """A counter from the metrics record (text in Redis), else ``fallback``."""
    try:
        return int(value) if isinstance(value, str | int | float) and value != "" else fallback
    except (TypeError, ValueError):
        return fallback

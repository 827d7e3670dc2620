"""worker train --tensorboard-dir: the per-step records become TensorBoard scalars."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from producer.cli import main
from workers.train.tensorboard import log_step


def _record(step: int, loss: float, **extra: float) -> dict:
    # As workers.train.task.train_step builds it (slot accuracies as a JSON list).
    return {"step": step, "loss": loss, "slot1_accuracy": 0.5, "acceptance_length": 1.8,
            "slot_accuracy": json.dumps([0.5, 0.25]), "tokens_per_s": 1234.5,
            "at": 1.0e9, **extra}


def _scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path))
    events.Reload()
    return {tag: [(e.step, round(e.value, 4)) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_steps_are_written_with_tau_when_present(tmp_path: Path) -> None:
    log_step(str(tmp_path), "r", _record(1, 2.5))
    log_step(str(tmp_path), "r", _record(2, 2.0, tau=2.25))
    log_step("", "r", _record(3, 1.0))  # off: nothing written anywhere
    scalars = _scalars(tmp_path / "r")
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.0)]
    assert scalars["train/tau"] == [(2, 2.25)]
    assert scalars["train/tokens_per_s"] == [(1, 1234.5), (2, 1234.5)]
    assert scalars["slot_accuracy/slot2"] == [(1, 0.25), (2, 0.25)]
    assert "train/at" not in scalars and "train/step" not in scalars


def test_worker_train_takes_the_option() -> None:
    result = CliRunner().invoke(main, ["worker", "train", "--help"])
    assert result.exit_code == 0 and "--tensorboard-dir" in result.output
    from common.config import load_settings

    # The option reaches the worker process as its setting's variable.
    assert load_settings({"DFLASH_TENSORBOARD_DIR": "/tb"}).train.tensorboard_dir == "/tb"

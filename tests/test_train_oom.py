"""Out of memory in a training step, survived: one rank or a group of two (DDP replicas or
FSDP2 shards, real gloo ranks) retries the step on every rank at half the budget with
activation checkpointing on, and the retried step's update is the unfaulted one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import load_settings
from common.errors import ConfigError, RankFailed
from common.runs.checkpoints import OUT_OF_MEMORY, Ledger, read_ledger
from common.runs.trainrows import TrainingRow
from common.storage import open_storage
from tests.conftest import Pipeline, wait_until
from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
from tests.test_train_e2e import TRAIN_ENV
from tests.test_train_parallel import (  # noqa: F401 - the module-scoped reference fixture
    STEPS,
    assert_same_steps,
    assert_same_trainer,
    reference,
    two_ranks,
)
from workers.train.agreement import Failure, failed_part
from workers.train.drafter.microbatch import Drawn, OutOfMemory

pytestmark = pytest.mark.xdist_group("train_parallel")

# Rank 1's third micro-batch fails in its forward (step 2), rank 0's fifth in its backward
# (step 3, in the micro-batches of the halved budget).
FAULTS = "train.forward.rank1=oom@3;train.backward.rank0=oom@5"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_group_retries_an_out_of_memory_step_on_every_rank(
        reference: dict, model_cache: Path, tmp_path: Path, mode: str,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_TEST_FAULT", FAULTS)
    steps, state = two_ranks(model_cache, tmp_path, 0, STEPS, mode)
    assert steps["oom_retries"] == [0, 0, 1, 1], steps
    # The halved budget and checkpointing stay on after the first retry.
    assert steps["recompute"] and steps["budget"] > 0
    # Each retried step's gradient is the unfaulted step's: the pre-clip norms, the losses and
    # the trained state are one rank's with no fault at all.
    assert_same_steps(steps, reference, 0)
    assert_same_trainer(state, reference["state"])


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_training_group_trains_past_out_of_memory_steps(pipeline: Pipeline, tmp_path: Path,
                                                           mode: str) -> None:
    """A real ``worker train --nproc-per-node 2`` (DDP or ``--fsdp``) with the same two faults:
    training goes past both to the end of its epoch, the group lives, nothing parks, and
    ``status`` counts the two retries."""
    run = f"oom-{mode}"
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(28))
    group = pipeline.start_worker(
        "trainer", "--nproc-per-node", "2", *(["--fsdp"] if mode == "fsdp" else []),
        kind="train", **{**TRAIN_ENV, "DFLASH_TRAIN_ROWS_PER_STEP": "2",
                         "DFLASH_TRAIN_CHECKPOINT_STEPS": "4", "DFLASH_TRAIN_EVAL_STEPS": "0",
                         "DFLASH_TEST_FAULT": FAULTS})
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", run, "--shard-size", "7", "--mode",
                 "online", "--epochs", "1", "--max-new-tokens", "128", "--heldout-min", "0",
                 "--heldout-fraction", "0", check=True)
    wait_until(lambda: read_ledger(storage, run).finished, 480, "the epoch trained")
    status = pipeline.status(run)
    train = status["downstream"]["train"]
    assert int(train["step"]) > 10, train
    assert train["oom_retries"] == 2, train
    assert not status["parked"], status["parked"]
    assert read_ledger(storage, run).oom_retries == 2
    assert group.poll() is None, "the group stopped"
    text = pipeline.cli("status", "--run", run, check=True).stdout
    assert "2 out-of-memory retries" in text, text
    log = (pipeline.log_dir / "trainer.log").read_text()
    assert "retrying the step at" in log and "GroupLost" not in log


def drawn_row(tokens: int) -> Drawn:
    return Drawn(TrainingRow(f"r{tokens}", 0, [1] * tokens, [1] * tokens), torch.arange(2))


def test_a_stand_in_that_fails_blames_no_row_and_a_lone_row_goes_after_two_failures() -> None:
    """Rank 1's padding repeats rank 0's shortest row: its failure halves the budget and sets
    nothing aside; a real lone row is set aside only when it fails twice, checkpointed."""
    short, other = drawn_row(100), drawn_row(300)
    parts, real = [[[short]], [[other], [short]]], [1, 1]
    stand_in = RankFailed("rank 1: oom", [Failure(1, 1, True, "rank 1: oom")])
    assert failed_part(stand_in, parts, real) is None
    own = RankFailed("rank 1: oom", [Failure(1, 0, True, "rank 1: oom")])
    assert failed_part(own, parts, real) == [other]
    with pytest.raises(RankFailed):   # not memory: the shard parks as before
        failed_part(RankFailed("rank 0: bug", [Failure(0, 0, False, "bug")]), parts, real)
    oom = OutOfMemory()
    oom.configure(1000)
    rows = [short, other]
    assert oom.retry(rows, None, 1) == rows and (oom.current, oom.recompute) == (500, True)
    assert oom.retry(rows, [other], 1) == rows and oom.set_aside == 0
    assert oom.retry(rows, [other], 1) == [short] and oom.set_aside == 1
    assert oom.retries == 3


def test_rows_set_aside_out_of_memory_count_as_too_long() -> None:
    ledger = Ledger(set_aside={"0": {"too_long": 1, OUT_OF_MEMORY: 2}, "1": {"too_short": 1}})
    assert ledger.set_aside_counts() == {"too_short": 1, "too_long": 3, "cut": 0}
    assert Ledger.from_json(ledger.to_json()) == ledger
    assert Ledger.from_json({"epoch": 0, "done": []}).oom_retries == 0   # an older ledger


@pytest.mark.parametrize(("raw", "ok"), [("0", True), ("0.2", True), ("0.5", False),
                                         ("nan", False), ("-0.1", False)])
def test_the_memory_margin_is_a_share_below_a_half(raw: str, ok: bool) -> None:
    env = {"DFLASH_TRAIN_MEMORY_MARGIN": raw}
    if ok:
        assert load_settings(env).train.memory_margin == float(raw)
    else:
        with pytest.raises(ConfigError, match="DFLASH_TRAIN_MEMORY_MARGIN"):
            load_settings(env)

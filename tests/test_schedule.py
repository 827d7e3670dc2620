"""The learning-rate schedule made from the data: revisions never jump, no step runs at 0,
the planned total follows the ledger and the manifest, epochs visit shards in a seeded order."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from common.runs.checkpoints import Ledger
from common.runs.epochs import row_order, shard_order
from common.runs.records import RunConfig
from workers.train.drafter.schedule import Schedule
from workers.train.drafter.train import lr_factor
from workers.train.epochs import note_shard, patience_spent, schedule_spent
from workers.train.plan import planned_total


def test_unrevised_schedule_is_warmup_then_cosine() -> None:
    schedule = Schedule(4, 100)
    assert [schedule.factor(s) for s in range(101)] == \
        [lr_factor(s, 4, 100) for s in range(101)]
    assert schedule.factor(99) > 0 and schedule.factor(100) == pytest.approx(0.0)


@pytest.mark.parametrize("revisions", [[(30, 200)], [(10, 60), (40, 300), (250, 280)],
                                       [(2, 500)], [(50, 51)]])
def test_revisions_keep_the_rate_continuous_and_end_at_the_last_step(
        revisions: list[tuple[int, int]]) -> None:
    """Each revision at step s to total T: the factor at s is unchanged, the decay reaches 0
    exactly at T and no step before T-1 ... 0 has factor 0; decay never rises again."""
    schedule = Schedule(4, 100)
    factors = []
    steps = iter(revisions)
    nxt = next(steps, None)
    step = 0
    while step < schedule.total:
        if nxt is not None and step == nxt[0]:
            before = schedule.factor(step)
            assert schedule.revise(nxt[1], step)
            assert schedule.factor(step) == pytest.approx(before)   # no jump
            nxt = next(steps, None)
        factors.append(schedule.factor(step))
        step += 1
    assert len(factors) == revisions[-1][1]          # the last revision's total, exactly
    assert all(f > 0 for f in factors)               # never a step at learning rate 0
    decay = factors[4:]
    assert all(a >= b - 1e-12 for a, b in zip(decay, decay[1:], strict=False))
    assert schedule.factor(schedule.total) == pytest.approx(0.0)   # reached only past the end


def test_a_revision_below_the_steps_taken_ends_there() -> None:
    schedule = Schedule(1, 10)
    assert schedule.revise(3, 7) and schedule.total == 7 and schedule.factor(6) > 0


def test_planned_total_estimates_then_becomes_exact() -> None:
    config = RunConfig(run="r", model="m", input="x", format="auto", prompt_field=None,
                       shard_size=10, limit=None, epochs=3, heldout_fraction=0.1)
    manifest_rows = [10, 10, 10, 6]
    ledger = Ledger()
    first, basis = planned_total(ledger, config, manifest_rows, 4)
    assert first == 3 * sum(math.ceil(n * 0.9 / 4) for n in manifest_rows)
    assert "nothing trained yet" in basis
    # Two turns per sample: shard 0 yields 18 rows (1 held out): 5 steps of 4 rows.
    note_shard(ledger, 0, 18, 4)
    revised, basis = planned_total(ledger, config, manifest_rows, 4)
    assert revised == 3 * (5 + 2 * math.ceil(18.0 / 4) + math.ceil(6 * 1.8 / 4))
    assert "1 trained shard" in basis
    for shard, rows in ((1, 20), (2, 17), (3, 11)):
        note_shard(ledger, shard, rows, 4)
    exact, basis = planned_total(ledger, config, manifest_rows, 4)
    assert exact == 3 * (5 + 5 + 5 + 3) and "exact" in basis


def test_epoch_orders_are_seeded_and_differ() -> None:
    shards = set(range(12))
    assert shard_order("r", 0, shards) == list(range(12))
    second, third = shard_order("r", 1, shards), shard_order("r", 2, shards)
    assert sorted(second) == list(range(12)) and second != list(range(12)) and second != third
    assert shard_order("r", 1, shards) == second            # the same in every process
    rows = list(range(40))
    assert row_order("r", 0, 3, rows) == rows
    assert row_order("r", 1, 3, rows) != rows and row_order("r", 1, 3, rows) != \
        row_order("r", 1, 4, rows)


def test_patience_counts_evaluations_without_a_better_tau() -> None:
    assert not patience_spent([1.2, 1.3, 1.3], 2)
    assert patience_spent([1.2, 1.4, 1.3, 1.4], 2)
    assert not patience_spent([1.2, 1.4, 1.3, 1.5], 2)
    assert not patience_spent([1.2, None, 1.1], None)


def _session(steps: int, total: int) -> SimpleNamespace:
    trainer = SimpleNamespace(steps=steps, schedule=Schedule(1, total))
    return SimpleNamespace(steps=steps, trainer=trainer, ledger=Ledger())


def test_an_explicit_total_steps_finishes_the_run_in_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """--total-steps ran out with rows left: training finishes and says so, no step at lr 0."""
    config = RunConfig(run="r", model="m", input="x", format="auto", prompt_field=None,
                       shard_size=4, limit=None, epochs=3)
    ctx = SimpleNamespace(settings=SimpleNamespace(train=SimpleNamespace(total_steps=5,
                                                                       rows_per_step=4)))
    assert not schedule_spent(ctx, _session(4, 5), config, 1, 8)
    session = _session(5, 5)
    with caplog.at_level(logging.WARNING):
        assert schedule_spent(ctx, session, config, 1, 8)
    assert session.ledger.finished == "total-steps"
    assert [r.getMessage() for r in caplog.records if "training finished" in r.getMessage()] \
        == ["run r: training finished at step 5, the end of the --total-steps schedule, in epoch "
            "1 of 3 with 8 row(s) of shard 1 and any later shards untrained; unset --total-steps "
            "to size the schedule from the data"]
    # A schedule made from the data is extended instead, and says so.
    ctx.settings.train.total_steps = 0
    data = _session(5, 5)
    assert not schedule_spent(ctx, data, config, 1, 8)
    assert data.trainer.schedule.total == 7 and not data.ledger.finished

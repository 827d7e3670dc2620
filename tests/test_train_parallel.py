"""Data-parallel training on CPU (gloo, real ranks started by torch.distributed.run): two ranks
(DDP replicas or FSDP2 shards) train the drafter one rank trains, checkpoints move between
group sizes, and a real ``worker train --nproc-per-node 2`` survives a kill -9 of one rank."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch

from common.runs.checkpoints import committed_steps, load_checkpoint, read_ledger
from common.storage import open_storage
from tests import dp_probe
from tests.conftest import ROOT, Pipeline, wait_until
from tests.test_generate_e2e import _mt_bench_rows, _write_jsonl
from tests.test_train_e2e import TRAIN_ENV, adam_steps
from tests.tolerance import assert_close
from workers.train.drafter.features import with_target_features
from workers.train.drafter.train import DrafterTrainer, StepMetrics

# One worker runs the module under xdist: its module-scoped runs are shared, not repeated.
pytestmark = pytest.mark.xdist_group("train_parallel")

STEPS = 4
# float32 sums in another order (per-rank slices, all-reduce): ~2e-6 apart after 4 steps, on
# tensors whose largest values are ~1e-2 (moments) to ~1 (weights): checked on each one's scale.
PARAM_REL, LOSS_REL = 1e-4, 1e-5
# Every step is clipped and AdamW is scale-free, so the update alone cannot tell an averaged
# gradient from a summed or half-scaled one: the pre-clip norm (what the step reports) can.
NORM_REL = 1e-4


@pytest.fixture(scope="module")
def reference(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One rank, plain DrafterTrainer: losses and pre-clip gradient norms of steps 0..3, its
    state after 2 (on disk) and 4."""
    threads = torch.get_num_threads()
    target, mask_id = dp_probe.tiny(str(model_cache))
    trainer = dp_probe.trainer_for(target, mask_id, None)
    halfway = tmp_path_factory.mktemp("reference") / "step2.pt"
    initial = copy.deepcopy(trainer.drafter.state_dict())
    losses, norms = [], []
    for s in range(STEPS):
        if s == STEPS // 2:
            torch.save(copy.deepcopy(trainer.state_dict()), halfway)
        metrics = one_rank_step(trainer, target, s)
        losses.append(metrics.loss)
        norms.append(metrics.grad_norm)
    assert min(norms) > trainer.config.grad_clip   # clipped: the case the norms tell apart
    yield {"losses": losses, "grad_norms": norms, "state": trainer.state_dict(),
           "halfway": halfway, "target": target, "initial": initial}
    torch.set_num_threads(threads)


def one_rank_step(trainer: DrafterTrainer, target: torch.nn.Module, step: int) -> StepMetrics:
    rows = dp_probe.batch(step, target.config.vocab_size)
    layers = list(trainer.drafter.config.target_layer_ids)
    return trainer.step(with_target_features(target, rows, layers))


def two_ranks(model_cache: Path, out: Path, first: int, steps: int, mode: str,
              state: Path | None = None) -> tuple[dict[str, list[float]], dict]:
    """Steps ``first..`` on two gloo ranks (DDP or FSDP2): rank 0's losses and pre-clip
    gradient norms, and its trainer state at the end (each step's: ``out/state-N.pt``)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tests.dp_probe", str(model_cache), str(out), str(first), str(steps),
         *([str(state)] if state else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "DFLASH_TRAIN_PARALLEL": mode})
    assert result.returncode == 0, result.stderr[-4000:]
    return (json.loads((out / "steps.json").read_text()),
            torch.load(out / f"state-{first + steps}.pt", weights_only=True))


@pytest.fixture(scope="module")
def from_scratch(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Callable[[str], tuple[dict[str, list[float]], dict, Path]]:
    """Two ranks, steps 0..3, once per mode for the module (each launch costs a minute or
    more on 2 busy cores): the steps, the final state and the folder of per-step states."""
    runs: dict[str, tuple[dict[str, list[float]], dict, Path]] = {}

    def run(mode: str) -> tuple[dict[str, list[float]], dict, Path]:
        if mode not in runs:
            out = tmp_path_factory.mktemp(f"two-ranks-{mode}")
            runs[mode] = (*two_ranks(model_cache, out, 0, STEPS, mode), out)
        return runs[mode]

    return run


def assert_same_steps(steps: dict[str, list[float]], reference: dict, first: int) -> None:
    """Rank 0's losses and pre-clip gradient norms are one rank's, from step ``first`` on."""
    assert steps["losses"] == pytest.approx(reference["losses"][first:], rel=LOSS_REL)
    assert steps["grad_norms"] == pytest.approx(reference["grad_norms"][first:], rel=NORM_REL)


def assert_same_trainer(state: dict, expected: dict) -> None:
    assert state["steps"] == expected["steps"]
    assert adam_steps(state) == {expected["steps"]}
    assert torch.equal(state["rng"], expected["rng"]), "anchors drawn differently"
    for name, value in expected["drafter"].items():
        assert_close(state["drafter"][name], value, rel=PARAM_REL, what=name)
    moments = state["optimizer"]["state"]
    for index, expected_moments in expected["optimizer"]["state"].items():
        assert_close(moments[index]["exp_avg"], expected_moments["exp_avg"], rel=PARAM_REL,
                     what=f"exp_avg of parameter {index}")
    assert state["schedule"] == expected["schedule"]


MODES = pytest.mark.parametrize("mode", ["ddp", "fsdp"])


@MODES
def test_two_ranks_train_the_drafter_one_rank_trains(reference: dict, from_scratch: Callable,
                                                     mode: str) -> None:
    steps, state, _ = from_scratch(mode)
    assert_same_steps(steps, reference, 0)
    # It trained at all: every weight moved (the rows are random tokens, so the loss is not a
    # measure of progress here).
    trained = reference["state"]["drafter"]
    assert all(not torch.equal(trained[k], v) for k, v in reference["initial"].items())
    assert_same_trainer(state, reference["state"])


@MODES
def test_checkpoints_move_between_two_ranks_and_one(reference: dict, model_cache: Path,
                                                    from_scratch: Callable, tmp_path: Path,
                                                    mode: str) -> None:
    # Written by 1 rank (after step 2), resumed by 2.
    steps, state = two_ranks(model_cache, tmp_path / "up", STEPS // 2, STEPS // 2, mode,
                             reference["halfway"])
    assert_same_steps(steps, reference, STEPS // 2)
    assert_same_trainer(state, reference["state"])
    # Written by 2 ranks (after step 2), resumed by 1.
    state = torch.load(from_scratch(mode)[2] / f"state-{STEPS // 2}.pt", weights_only=True)
    target = reference["target"]
    trainer = DrafterTrainer.from_state_dict(state, target)
    losses = [one_rank_step(trainer, target, s).loss for s in range(STEPS // 2, STEPS)]
    assert losses == pytest.approx(reference["losses"][STEPS // 2:], rel=LOSS_REL)
    assert_same_trainer(trainer.state_dict(), reference["state"])


def rank_pid(launcher: subprocess.Popen[bytes], rank: int) -> int:
    """The pid of one rank among the launcher's children (from its RANK variable)."""
    for child in psutil.Process(launcher.pid).children():
        if child.environ().get("RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no rank {rank} under the launcher")


@pytest.mark.e2e
def test_a_group_survives_kill9_of_a_rank_and_an_fsdp_group_finishes(pipeline: Pipeline,
                                                                       tmp_path: Path) -> None:
    """kill -9 of a DDP rank mid-run stops its group; an FSDP2 group resumes from the DDP
    group's checkpoint, trains both epochs to the schedule's last step and measures tau on the
    way (one run: each group start costs ~30 s here)."""
    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(16))
    storage = open_storage(pipeline.env["DFLASH_STORAGE"])
    group = pipeline.start_worker("trainer", "--nproc-per-node", "2", kind="train", **TRAIN_ENV)
    ranks = [psutil.Process(rank_pid(group, r)) for r in (0, 1)]
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", "dp", "--shard-size", "4", "--mode",
                 "online", "--epochs", "2",
                 "--max-new-tokens", "128", "--heldout-min", "1", check=True)
    wait_until(lambda: committed_steps(storage, "dp"), 240, "a first drafter checkpoint")
    os.kill(ranks[1].pid, signal.SIGKILL)
    assert group.wait(timeout=120) != 0, "the group did not stop"
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
    before = committed_steps(storage, "dp")[-1]
    assert len(read_ledger(storage, "dp").done) < 4, "training ended before the kill"
    # The FSDP group measures tau as it trains: rank 0 decodes with the gathered drafter.
    pipeline.start_worker("trainer2", "--nproc-per-node", "2", "--fsdp", kind="train",
                          **TRAIN_ENV)
    pipeline.wait_done("dp")
    pipeline.cli("resume", "--run", "dp", check=True)  # shards acked after the last checkpoint
    wait_until(lambda: read_ledger(storage, "dp").finished, 360, "both epochs trained")
    ledger = read_ledger(storage, "dp")
    assert len(ledger.done) == len(set(ledger.done)) == 4 and not ledger.partial
    assert (ledger.epoch, ledger.finished) == (1, "schedule")
    final = committed_steps(storage, "dp")[-1]
    state, _ = load_checkpoint(storage, "dp", final)
    assert final > before and adam_steps(state) == {final} == {state["steps"]}
    # The group's schedule: rank 0's, exactly two epochs of the run's rows.
    assert final == 2 * sum(ledger.shard_steps.values()) == state["schedule"]["total"]
    assert "fsdp" in (pipeline.log_dir / "trainer2.log").read_text().lower()
    down = pipeline.status("dp")["downstream"]
    assert down["eval_error"] is None and int(down["tau_step"]) > before, down
    assert len(ledger.tau_by_epoch) == 2 and None not in ledger.tau_by_epoch
    train = down["train"]
    assert int(train["ranks"]) == 2 and int(train["hosts"]) == 1
    assert float(train["tokens_per_s"]) > 0
    text = pipeline.cli("status", "--run", "dp", check=True).stdout
    assert "tok/s on 2 ranks, 1 host(s)" in text, text


@pytest.mark.e2e
def test_a_rank_s_own_failure_parks_the_shard_on_its_first_delivery(pipeline: Pipeline,
                                                                    tmp_path: Path) -> None:
    """Not a lost group: the ranks agree on rank 1's OOM, stay in step, and the shard parks."""
    from common import keys
    from common.queue.celery_app import TRAIN
    from tests.test_healing_e2e import OOM, parked, redis_client

    src = _write_jsonl(tmp_path / "in.jsonl", _mt_bench_rows(4))
    group = pipeline.start_worker("trainer", "--nproc-per-node", "2", kind="train", **TRAIN_ENV,
                                  DFLASH_TEST_FAULT=f"train.forward.rank1={OOM}")
    pipeline.start_worker("gen")
    pipeline.cli("enqueue", "--input", src, "--run", "dpf", "--shard-size", "2", "--mode",
                 "online", "--epochs", "1", "--max-new-tokens", "128", "--heldout-min", "0",
                 "--heldout-fraction", "0", check=True)
    found = wait_until(lambda: len(parked(pipeline, "dpf", "train")) == 2
                       and parked(pipeline, "dpf", "train"), 300, "both train shards parked")
    assert all("rank 1" in p["reason"] and OOM in p["reason"] for p in found), found
    assert "GroupLost" not in "".join(p["reason"] for p in found)
    attempts = redis_client(pipeline).hgetall(TRAIN.keys("dpf").attempts)
    assert {attempts[keys.shard_name(s)] for s in (0, 1)} == {"1"}, attempts
    assert group.poll() is None, "the group stopped: the ranks fell out of step"


@pytest.mark.parametrize(("options", "error"), [
    (["--nproc-per-node", "2", "--gpu", "0"], "--gpu names one GPU"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29400"],
     "--node-rank 2 is not below --nnodes 2"),
    (["--fsdp"], "--fsdp shards the drafter over ranks"),
])
def test_bad_group_options_get_one_line_and_exit_1(options: list[str], error: str) -> None:
    result = subprocess.run([sys.executable, "-m", "producer.cli", "worker", "train", *options],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ")
    assert error in lines[0]


def test_hosts_meet_at_the_rendezvous_endpoint() -> None:
    from common.config import Settings
    from workers.launch import worker_argv
    from workers.train.group import TRAIN_LAUNCH, group_argv

    settings = Settings(train_nproc_per_node=8, train_nnodes=2, train_node_rank=1,
                        train_rdzv_endpoint="10.0.0.1:29400")
    celery = worker_argv(TRAIN_LAUNCH, gpu=None, concurrency=1, name="t@%h", loglevel="INFO")
    argv = group_argv(settings, None, celery)
    assert argv[1:12] == ["-m", "torch.distributed.run", "--nproc-per-node", "8", "--nnodes",
                          "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400", "-m"]
    assert argv[12:17] == ["workers.train.ranks", "-A", "workers.downstream_app", "worker", "-Q"]
    local = group_argv(Settings(train_nproc_per_node=2), None, celery)
    assert local[3:6] == ["--nproc-per-node", "2", "--standalone"]

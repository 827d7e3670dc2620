"""``plan-training`` at the reference run's shape (Qwen3.6-27B, 32K-token rows, 80 GB GPUs) and
the plan a training rank acts on: a replica per rank does not fit and FSDP does, the advice names
the fix, an epoch's hours scale with its rows, and bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import PlanDoesNotFit
from common.plan.shapes import DrafterDims, TargetDims
from common.plan.verdict import Hardware, TrainingPlan
from tests.conftest import ROOT
from workers.train.memory import check_resident, fits_row

SHAPE = ROOT / "benchmarks" / "shapes" / "qwen3.6-27b.json"
REFERENCE = ["--model", str(SHAPE), "--tokens", "32768", "--num-gpus", "8",
             "--gpu-memory-gib", "80"]
TERMS = {"target", "drafter_state", "features", "target_transient", "drafter_activations",
         "collective_buffers", "runtime", "total"}


def plan_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "plan-training", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def qwen36() -> tuple[TargetDims, DrafterDims]:
    target = TargetDims.load(SHAPE)
    return target, DrafterDims.of(target.shape)


def test_a_replica_per_rank_does_not_fit_and_fsdp_does() -> None:
    ddp = plan_cli(*REFERENCE, "--json")
    fsdp = plan_cli(*REFERENCE, "--fsdp", "--json")
    assert ddp.returncode == fsdp.returncode == 0, ddp.stderr + fsdp.stderr
    replica, sharded = json.loads(ddp.stdout), json.loads(fsdp.stdout)
    for plan in (replica, sharded):
        per = plan["per_rank_gib"]
        assert set(per) == TERMS and plan["gpu_memory_gib"] == 80
        assert all(value > 0 for key, value in per.items() if key != "collective_buffers")
        parts = sum(per[k] for k in ("target", "drafter_state", "features",
                                     "collective_buffers", "runtime"))
        peak = max(per["target_transient"], per["drafter_activations"])
        assert per["total"] == pytest.approx(parts + peak, abs=0.03)
        # Headroom by design: the budget's micro-batch and the longest row stay below the
        # usable memory less the margin (8% of it by default).
        assert plan["margin_gib"] == pytest.approx(0.08 * plan["usable_gib"], abs=0.01)
        assert plan["limit_gib"] == pytest.approx(plan["usable_gib"] - plan["margin_gib"],
                                                  abs=0.01)
    # FSDP2's backward holds a layer's unsharded bf16 gradients and its float32 reduce-scatter
    # input: 6 bytes a parameter of a 341 M-parameter layer.
    assert sharded["per_rank_gib"]["collective_buffers"] >= 1.5
    assert replica["per_rank_gib"]["collective_buffers"] == 0   # replicas reduce in place
    assert sharded["budget_peak_gib"] <= sharded["usable_gib"] - sharded["margin_gib"]
    assert sharded["per_rank_gib"]["total"] <= sharded["limit_gib"]
    # 26.9 B parameters in bf16, whole on every rank; 1.84 B drafter parameters at 16 bytes.
    assert replica["per_rank_gib"]["target"] == pytest.approx(26.896e9 * 2 / 2**30, rel=1e-3)
    assert replica["per_rank_gib"]["drafter_state"] == pytest.approx(1.835e9 * 16 / 2**30,
                                                                      rel=1e-3)
    assert not replica["fits"] and replica["max_tokens_that_fit"] == 0
    assert any(a.startswith("--fsdp") for a in replica["advice"]), replica["advice"]
    assert sharded["fits"] and sharded["max_tokens_that_fit"] >= 32768 and not sharded["advice"]
    assert sharded["per_rank_gib"]["drafter_state"] < replica["per_rank_gib"]["drafter_state"] / 4
    assert sharded["budget_tokens"] > 0 and sharded["epoch_hours"] is None
    text = plan_cli(*REFERENCE).stdout
    assert "does not fit" in text and "--fsdp" in text and "target weights" in text


def test_an_epoch_s_hours_follow_its_rows_and_the_gpus() -> None:
    one = json.loads(plan_cli(*REFERENCE, "--fsdp", "--rows", "1000", "--json").stdout)
    two = json.loads(plan_cli(*REFERENCE, "--fsdp", "--rows", "2000", "--json").stdout)
    assert one["epoch_hours"] > 0 and one["epoch_flops"] > 1000 * 2 * 26.9e9 * 32768
    assert two["epoch_flops"] == pytest.approx(2 * one["epoch_flops"], rel=1e-9)
    assert two["epoch_hours"] == pytest.approx(2 * one["epoch_hours"], rel=1e-3)
    half = json.loads(plan_cli(*REFERENCE, "--fsdp", "--rows", "1000", "--utilization", "0.2",
                               "--json").stdout)
    assert half["epoch_hours"] == pytest.approx(2 * one["epoch_hours"], rel=1e-3)
    more = json.loads(plan_cli(*REFERENCE[:-4], "--num-gpus", "16", "--gpu-memory-gib", "80",
                               "--fsdp", "--rows", "1000", "--json").stdout)
    assert more["epoch_hours"] == pytest.approx(one["epoch_hours"] / 2, rel=1e-3)


def test_a_longer_row_needs_more_and_a_larger_gpu_fits_a_replica(
        qwen36: tuple[TargetDims, DrafterDims]) -> None:
    target, drafter = qwen36
    h100 = Hardware(80, 8, fsdp=True)
    short, long = (TrainingPlan(target, drafter, h100, n) for n in (4096, 65536))
    assert long.step.features == 16 * short.step.features
    assert long.step.target_transient > 8 * short.step.target_transient
    big = TrainingPlan(target, drafter, Hardware(192, 1), 32768)
    assert big.fits and not big.advice() and big.budget > 0
    lean = TrainingPlan(target, drafter, Hardware(80, 8, fsdp=True), 32768,
                        checkpointing_mode="off")
    assert lean.step.drafter_activations > big.step.drafter_activations / 2
    assert not lean.step.checkpointing and TrainingPlan(
        target, drafter, h100, 32768).step.checkpointing


def test_a_rank_refuses_a_run_whose_resident_part_cannot_fit(
        qwen36: tuple[TargetDims, DrafterDims]) -> None:
    target, drafter = qwen36
    plan = TrainingPlan(target, drafter, Hardware(80, 8), 32768)
    with pytest.raises(PlanDoesNotFit, match="--fsdp"):
        check_resident(plan, "r")
    sharded = TrainingPlan(target, drafter, Hardware(80, 8, fsdp=True), 32768)
    check_resident(sharded, "r")
    check_resident(None, "r")   # the CPU: no plan, nothing refused
    longest = sharded.max_tokens_that_fit
    assert fits_row(sharded, longest, longest) and not fits_row(sharded, longest + 4096,
                                                                longest + 4096)
    assert fits_row(None, 10**7, 10**7)


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--tokens", "100"], 2, "give --run RUN, or --model and --tokens"),
    (["--model", "/nowhere", "--tokens", "100", "--gpu-memory-gib", "80"], 1,
     "no such model directory"),
    (["--model", str(SHAPE), "--tokens", "100"], 2, "give --gpu-memory-gib"),
    (["--model", str(SHAPE), "--tokens", "0", "--gpu-memory-gib", "80"], 2, "--tokens"),
    (["--run", "bad/id", "--gpu-memory-gib", "80"], 2, "invalid run id"),
])
def test_bad_input_is_one_line(args: list[str], code: int, message: str,
                               tmp_path: Path) -> None:
    result = plan_cli(*args, "--storage", str(tmp_path))
    assert result.returncode == code, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_published_drafter_shape_is_planned_as_given(tmp_path: Path) -> None:
    config = tmp_path / "drafter.json"
    config.write_text(json.dumps({"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2,
                                  "intermediate_size": 8192,
                                  "dflash_config": {"target_layer_ids": [1, 20, 40]}}))
    small = json.loads(plan_cli(*REFERENCE, "--drafter-config", str(config), "--json").stdout)
    full = json.loads(plan_cli(*REFERENCE, "--json").stdout)
    assert small["drafter_params"] < full["drafter_params"] / 3
    assert small["per_rank_gib"]["features"] == pytest.approx(
        full["per_rank_gib"]["features"] * 3 / 5, abs=0.01)
    config.write_text(json.dumps({"architectures": ["DSparkDraftModel"]}))
    refused = plan_cli(*REFERENCE, "--drafter-config", str(config))
    assert refused.returncode == 1 and "DSpark" in refused.stderr


def test_the_training_guide_holds_the_plan_s_table() -> None:
    """docs/guides/training.md's memory table is what benchmarks/memory_table.py prints now."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from memory_table import table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    guide = (ROOT / "docs" / "guides" / "training.md").read_text()
    assert table() in guide, "regenerate it: python benchmarks/memory_table.py"


def test_a_smaller_margin_plans_a_larger_budget() -> None:
    tight = json.loads(plan_cli(*REFERENCE, "--fsdp", "--json", "--memory-margin", "0.02").stdout)
    default = json.loads(plan_cli(*REFERENCE, "--fsdp", "--json").stdout)
    assert tight["margin_gib"] < default["margin_gib"]
    assert tight["budget_tokens"] > default["budget_tokens"]
    assert tight["budget_peak_gib"] <= tight["limit_gib"]

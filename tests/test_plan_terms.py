"""Each term of the training memory plan (:mod:`common.plan.memory`) against a measurement of
the same computation at the plan's dtype, on the tiny targets: bf16 weights and features, bf16
autocast for the drafter's step (the CPU's autocast, the GPU's casting policy), DDP and FSDP2
on a 2-rank gloo group, fla's Gated DeltaNet allocations (:mod:`tests.fla_replay`); at sizes
where the term is at least ``SHARE`` of what is measured, within ``REL``. And the verdicts the
plan gives a training rank: a session parked with the fix, rows no micro-batch fits set aside.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from common.errors import PlanDoesNotFit
from common.plan.memory import (
    Device,
    Micro,
    StepMemory,
    collective_bytes,
    drafter_state_bytes,
    features_bytes,
    gated_delta_net_bytes,
    gathered_bytes,
    mask_build_bytes,
    target_bytes,
    target_transient_bytes,
)
from common.plan.shapes import DrafterDims, TargetDims
from common.plan.verdict import Hardware, TrainingPlan
from embedded.memtrack import LiveBytes
from embedded.tinymodel import ensure_tiny_model
from tests.conftest import ROOT, TinyTarget
from tests.fla_replay import fla_allocations
from tests.test_training_memory import one_thread, random_row  # noqa: F401 - autouse fixture
from workers.train.drafter.features import target_features
from workers.train.drafter.masks import flex_block_mask
from workers.train.drafter.model import DFlashDraftModel, add_mask_token
from workers.train.drafter.train import DrafterTrainer, TrainConfig
from workers.train.memory import check_resident, fits_row

pytestmark = pytest.mark.xdist_group("train_parallel")   # the group launch, once per run

REL = 0.15       # each term within this share of its measurement
SHARE = 0.30     # of the measurement, the term checked at least
LAYERS = (1, 3, 5, 7)
BF16 = Device(cuda=True, attention="sdpa")   # bf16 byte counts; the CPU's dense SDPA kernel
CPU = Device(cuda=False)
GROUP = Device(cuda=False, ranks=2)


def assert_term(planned: int, measured: int, term: int, what: str) -> None:
    """``planned`` within REL of ``measured``, where ``term`` is at least SHARE of it."""
    assert planned == pytest.approx(measured, rel=REL), f"{what}: planned {planned:,}, " \
        f"measured {measured:,} ({planned / measured:.3f}x)"
    assert term >= SHARE * measured, f"{what}: {term:,} is under {SHARE:.0%} of {measured:,}"


@dataclass(frozen=True)
class Bf16:
    """A tiny target loaded in bf16 (as on a GPU), its plan dims and mask id."""

    path: Path
    model: Any
    dims: TargetDims
    mask_id: int


def load_bf16(path: Path) -> Bf16:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    mask_id = add_mask_token(AutoTokenizer.from_pretrained(path), model)
    model.requires_grad_(False)
    return Bf16(path, model, TargetDims.load(path), mask_id)


@pytest.fixture(scope="module")
def bf16(target_model: TinyTarget) -> Bf16:
    return load_bf16(target_model.path)


@pytest.fixture(scope="module")
def dense(model_cache: Path) -> Bf16:
    return load_bf16(ensure_tiny_model(model_cache, "tiny-qwen3"))


@pytest.fixture(scope="module")
def hybrid(model_cache: Path) -> Bf16:
    return load_bf16(ensure_tiny_model(model_cache, "tiny-qwen3.5"))


def test_target_weights(bf16: Bf16) -> None:
    """The weights a bf16 load holds, against the plan's count from config.json alone."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*bf16.model.parameters(), *bf16.model.buffers())}
    measured = sum(storages.values())
    assert_term(target_bytes(bf16.dims), measured, target_bytes(bf16.dims), "target weights")


def forward(target: Bf16, tokens: int) -> tuple[int, int]:
    """The capture's bytes kept (the features) and its peak, one row of ``tokens``."""
    with torch.no_grad(), LiveBytes() as live:
        features = target_features(target.model, [random_row(tokens, tokens)], LAYERS)
        kept = live.settle()
    del features
    return kept, live.peak


def test_features(bf16: Bf16) -> None:
    kept, _ = forward(bf16, 1500)
    planned = features_bytes(bf16.dims, DrafterDims.of(bf16.dims.shape, layer_ids=LAYERS), 1500)
    assert_term(planned, kept, planned, "features")


def test_target_transient_dense(dense: Bf16) -> None:
    """The dense target's forward beyond its features (its MLP is the widest layer)."""
    kept, peak = forward(dense, 3000)
    planned = target_transient_bytes(dense.dims, Micro.row(3000))
    assert_term(planned, peak - kept, planned, "target transient")


def test_target_transient_gated_delta_net(hybrid: Bf16) -> None:
    """The hybrid's forward beyond its features, its Gated DeltaNet layers allocating what fla
    0.5's chunked kernel allocates (:mod:`tests.fla_replay`: the kernel's tensors replayed
    from its sources, in the real layer around them); the term is the widest layer's."""
    with fla_allocations():
        kept, peak = forward(hybrid, 3000)
    planned = target_transient_bytes(hybrid.dims, Micro.row(3000))
    assert_term(planned, peak - kept, gated_delta_net_bytes(hybrid.dims, 3000), "Gated DeltaNet")


class Autocast(types.ModuleType):
    """torch as the trainer's module sees it, with its bf16 autocast on for the CPU too."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def autocast(device_type: str, dtype: torch.dtype, enabled: bool) -> Any:
        return torch.autocast(device_type, dtype=dtype, enabled=True)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("chunk", [0, 256], ids=["logits-kept", "logits-recomputed"])
def test_drafter_activations_under_bf16_autocast(dense: Bf16, checkpointing: bool, chunk: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafter's step under bf16 autocast on bf16 target heads (the GPU's casting policy;
    the kernel is the CPU's dense SDPA: ``attention="sdpa"``), 1,024 draft positions."""
    monkeypatch.setattr("workers.train.drafter.train.torch", Autocast("torch"))
    drafter = DFlashDraftModel.for_target(dense.model, dense.mask_id, init_seed=0)
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=4, max_anchors=64,
                                                  logits_chunk=chunk), functools.partial(
        target_features, dense.model, layer_ids=drafter.config.target_layer_ids))
    drawn, _ = trainer.draw([random_row(1500, 1500)])
    batch = trainer.pack(drawn)
    drafter.checkpointing = checkpointing
    for p in drafter.parameters():   # the state's gradients, not the step's
        p.grad = torch.zeros_like(p)
    with LiveBytes() as live:
        loss, _ = trainer.forward_sum(batch)
        loss.backward()
    micro = Micro(1, 1500, 1500, batch.blocks * batch.block_size, int(batch.valid.sum()))
    plan = StepMemory.of(dense.dims, DrafterDims.from_config(drafter.config), micro, BF16,
                         checkpointing, chunk or None)
    assert_term(plan.drafter_activations, live.peak, plan.drafter_activations, "drafter step")


@pytest.mark.parametrize("kind", [(None, True), (64, False)], ids=["causal", "window"])
def test_mask_build(kind: tuple[int | None, bool]) -> None:
    """flex's ``create_block_mask`` over 128 blocks and 1,024 context tokens (eager, as the
    GPU's; a window or a causal block: 4 bytes a cell, the plan's; the plain rule: 3)."""
    anchors = torch.arange(8, 1024, 8)[:128]
    micro = Micro(1, 1024, 1024, 128 * 16, 0)
    peaks = []
    for window, causal in (kind, (None, False)):
        with LiveBytes() as live:
            flex_block_mask(anchors, torch.zeros_like(anchors), 1024, 16, "cpu", window, causal)
        peaks.append(live.peak)
    planned = mask_build_bytes(micro, Device(cuda=True))
    assert_term(planned, peaks[0], planned, "mask build")
    assert peaks[1] == pytest.approx(0.75 * planned, rel=0.02)   # the plan's bound holds


def test_drafter_state_on_one_rank(dense: Bf16) -> None:
    """Weights, gradients and AdamW moments made since the build, after an optimizer step."""
    row = random_row(200, 0)
    held: list[int] = []
    with LiveBytes() as live:
        drafter = DFlashDraftModel.for_target(dense.model, dense.mask_id, init_seed=0)
        trainer = DrafterTrainer(drafter, TrainConfig(total_steps=4, max_anchors=4),
                                 functools.partial(target_features, dense.model,
                                                   layer_ids=drafter.config.target_layer_ids))
        trainer.optimizer.register_step_post_hook(lambda *args: held.append(live.settle()))
        trainer.step([row])
    planned = drafter_state_bytes(DrafterDims.from_config(drafter.config), CPU)
    assert_term(planned, held[0], planned, "drafter state")


@pytest.fixture(scope="module")
def group_terms(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/fsdp_probe.py's figures from 2 gloo ranks (DDP, then FSDP2), once per module."""
    out = tmp_path_factory.mktemp("fsdp-probe")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tests.fsdp_probe", str(model_cache), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-4000:]
    figures: dict[str, Any] = json.loads((out / "terms.json").read_text())
    from workers.train.drafter.config import DFlashConfig

    figures["dims"] = DrafterDims.from_config(DFlashConfig(**figures["drafter_config"]))
    return figures


def test_drafter_state_under_ddp(group_terms: dict[str, Any]) -> None:
    """A replica after its step: weights, gradients and moments; no buckets (no DDP module)."""
    planned = drafter_state_bytes(group_terms["dims"], GROUP)
    assert_term(planned, group_terms["ddp_state"], planned, "DDP state")


def test_drafter_state_under_fsdp2(group_terms: dict[str, Any]) -> None:
    """An FSDP2 rank's shards after its step; a forward's gathered parameters (the root group
    and three layers for an instant: the plan's two and the previous all-gather's buffer)."""
    dims, fsdp = group_terms["dims"], Device(cuda=False, ranks=2, fsdp=True)
    gathered = gathered_bytes(dims, fsdp)
    shards = drafter_state_bytes(dims, fsdp) - gathered
    assert_term(shards, group_terms["fsdp_shards"], shards, "FSDP2 shards")
    forward_peak = gathered + dims.layer_params * fsdp.act_bytes
    assert_term(forward_peak, group_terms["fsdp_gathered"], gathered, "FSDP2 gathered")


def test_collective_buffers_under_fsdp2(group_terms: dict[str, Any]) -> None:
    """A backward accumulating into the sharded gradients: the two layers it gathers again (the
    root stays gathered from the forward) and the reduce-scatter's buffers, short rows."""
    dims, fsdp = group_terms["dims"], Device(cuda=False, ranks=2, fsdp=True)
    buffers = collective_bytes(dims, fsdp)
    planned = 2 * dims.layer_params * fsdp.act_bytes + buffers
    assert_term(planned, group_terms["fsdp_backward"], buffers, "collective buffers")
    assert collective_bytes(dims, GROUP) == 0   # replicas all-reduce their gradients in place


def small_plan(target: TargetDims, gib: float) -> TrainingPlan:
    drafter = DrafterDims.of(target.shape, layer_ids=LAYERS)
    return TrainingPlan(target, drafter, Hardware(gib, cuda=False, margin=0.0), 4096)


def test_a_session_whose_resident_part_does_not_fit_parks_naming_the_fix(dense: Bf16) -> None:
    resident = small_plan(dense.dims, 1).step.resident
    plan = small_plan(dense.dims, resident / 2**30 * 0.9)
    with pytest.raises(PlanDoesNotFit, match="leave no room for a step of 33 tokens; fix: .*"
                                             "a larger GPU"):
        check_resident(plan, "r1")
    check_resident(small_plan(dense.dims, 1), "r1")   # fits: logs its verdict


def test_rows_no_micro_batch_fits_are_counted_too_long(dense: Bf16) -> None:
    """As ``training_rows`` counts them: rows whose one-row micro-batch does not fit."""
    plan = small_plan(dense.dims, 1)
    limit = plan.max_tokens_that_fit
    lengths = [200, limit // 2, limit, limit + 1, 2 * limit]
    too_long = [n for n in lengths if not fits_row(plan, n, n - 16)]
    assert too_long == [limit + 1, 2 * limit] and fits_row(None, 10**9, 10**9)

"""An epoch's hours: the plan counts the target's forward as the capture runs it (no embedding
matmul, no layer past the deepest captured one) and the logits' recompute, checked against the
FLOPs torch counts on the tiny targets; a training step's planned and measured hours reach
``status`` (its JSON and its text) through a real Redis."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from common import keys
from common.choices import Checkpointing
from common.config import load_settings
from common.plan.compute import RowLength, drafter_flops, target_flops
from common.plan.shapes import DrafterDims, TargetDims
from common.plan.verdict import Hardware, TrainingPlan
from common.runs.checkpoints import Ledger
from common.runs.records import RunConfig, ShardTask, dumps
from common.runs.store import RunStore
from common.runs.trainrows import TrainingRow
from common.storage import LocalStorage
from producer.commands import render_status
from producer.status import StatusReader
from tests.conftest import RedisServer, TinyTarget
from workers.context import WorkerContext
from workers.train.drafter.features import target_features
from workers.train.drafter.model import DFlashDraftModel, add_mask_token
from workers.train.drafter.target_loader import load_target
from workers.train.drafter.train import DrafterTrainer, TrainConfig
from workers.train.epochs import note_shard, revise_schedule
from workers.train.pace import EpochPace
from workers.train.session import Session
from workers.train.task import train_step

RUN = "hours"
LINEAR = {"aten.mm", "aten.addmm"}   # the linear layers' products (CPU attention: not counted)


@dataclass(frozen=True)
class Tiny:
    target: Any
    mask_id: int
    dims: TargetDims


@pytest.fixture(scope="module")
def tiny(target_model: TinyTarget) -> Iterator[Tiny]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target, tokenizer = load_target(target_model.path)
    mask_id = add_mask_token(tokenizer, target)
    target.requires_grad_(False)
    yield Tiny(target, mask_id, TargetDims.of_model(target))
    torch.set_num_threads(threads)


def random_row(tokens: int, seed: int = 0, name: str = "r") -> TrainingRow:
    ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(seed))
    return TrainingRow(name, 0, ids.tolist(), [0] * 16 + [1] * (tokens - 16))


def linear_flops(counter: FlopCounterMode) -> int:
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in LINEAR)


def test_each_layers_parameters_come_from_the_config_alone(tiny: Tiny,
                                                           target_model: TinyTarget) -> None:
    """The meta-device build gives each decoder layer's parameters, as the loaded model has
    them; the embedding and the LM head are none of them."""
    loaded = TargetDims.load(target_model.path)
    layers = tiny.target.get_decoder().layers
    assert loaded.layer_params == tiny.dims.layer_params == tuple(
        sum(p.numel() for p in layer.parameters()) for layer in layers)
    shape = tiny.dims.shape
    embedding = shape.vocab_size * shape.hidden_size
    assert tiny.dims.trunk_params(shape.num_layers) <= tiny.dims.params - embedding


@pytest.mark.parametrize("target_model", ["tiny-qwen3"], indirect=True)
@pytest.mark.parametrize("layer_ids", [(1, 3), (1, 3, 5, 7)], ids=["deepest-3", "deepest-last"])
def test_the_target_flops_are_the_captures_own(tiny: Tiny, layer_ids: tuple[int, ...]) -> None:
    """The capture's linear layers' FLOPs, as torch counts them, are the plan's less its
    attention: layers 0..deepest only, no embedding product, no LM head."""
    tokens = 600
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        target_features(tiny.target, [random_row(tokens)], layer_ids)
    shape, deepest = tiny.dims.shape, max(layer_ids)
    q_width = (shape.num_attention_heads or 0) * (shape.head_dim or 0)
    attention = 2.0 * (deepest + 1) * tokens * tokens * q_width   # every layer is full here
    planned = target_flops(tiny.dims, tokens, deepest) - attention
    # The norms' weights are parameters without a product: a few in ten thousand.
    assert linear_flops(counter) == pytest.approx(planned, rel=2e-3)
    drafter = DrafterDims.of(shape, layer_ids=layer_ids)
    assert drafter.deepest_layer == deepest
    assert target_flops(tiny.dims, tokens, drafter.deepest_layer) == target_flops(
        tiny.dims, tokens, deepest)


@pytest.mark.parametrize("target_model", ["tiny-qwen3"], indirect=True)
def test_the_logits_recompute_is_counted(tiny: Tiny) -> None:
    """Past one chunk of labels the trainer runs the logits forward again in the backward:
    torch counts one more pass of the LM head, and so does the plan."""
    counted = {}
    for chunk in (64, 1 << 20):
        drafter = DFlashDraftModel.for_target(tiny.target, tiny.mask_id, init_seed=0)
        layers = drafter.config.target_layer_ids
        trainer = DrafterTrainer(drafter, TrainConfig(total_steps=4, max_anchors=16,
                                                      logits_chunk=chunk))
        features = target_features(tiny.target, [random_row(400)], layers)
        trainer.featurize = lambda rows, kept=features: kept
        drawn, _ = trainer.draw([random_row(400)], torch.Generator().manual_seed(0))
        batch = trainer.pack(drawn)
        with FlopCounterMode(display=False) as counter:
            loss, _ = trainer.forward_sum(batch)
            loss.backward()
        counted[chunk] = linear_flops(counter)
        labels = int(batch.valid.sum())
    dims = DrafterDims.from_config(drafter.config)
    one_pass = 2.0 * labels * dims.hidden_size * dims.vocab_size
    assert counted[64] - counted[1 << 20] == pytest.approx(one_pass, rel=1e-6)
    row = RowLength(400, 384)
    assert labels == 16 * (dims.block_size - 1)   # the plan's anchors: 16 drawn, all labelled
    recomputed = drafter_flops(dims, row, 16, logits_chunk=64)
    assert recomputed - drafter_flops(dims, row, 16, logits_chunk=1 << 20) == one_pass


def session_for(tiny: Tiny, plan: bool) -> Session:
    """A train worker's session on the tiny target; with a plan at a made-up CPU rate."""
    drafter = DFlashDraftModel.for_target(tiny.target, tiny.mask_id, init_seed=0)
    layers = list(drafter.config.target_layer_ids)
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=8, max_anchors=8),
                             lambda rows: target_features(tiny.target, rows, layers), 1)
    made = TrainingPlan(tiny.dims, DrafterDims.from_config(drafter.config),
                        Hardware(64, cuda=False), 256, Checkpointing.OFF, 8,
                        utilization=1.0, tflops=1e-3) if plan else None
    return Session(RUN, tiny.target, trainer, Ledger(), layers, 0, 0, plan=made,
                   pace=EpochPace(made))


@pytest.mark.parametrize("target_model", ["tiny-qwen3"], indirect=True)
@pytest.mark.parametrize("plan", [True, False], ids=["planned", "cpu-no-plan"])
def test_status_shows_the_planned_and_measured_hours(tiny: Tiny, redis_server: RedisServer,
                                                     tmp_path: Path, plan: bool) -> None:
    """Three steps through the worker's own step (its metrics record to a real Redis): the
    first is a warm-up; status gives the other two's hours per epoch, planned beside
    measured, in ``--json`` and in its text."""
    settings = load_settings().replace(storage=str(tmp_path / "storage"),
                                       broker_url=redis_server.url, train_rows_per_step=2)
    ctx = WorkerContext(settings)
    storage = LocalStorage(str(tmp_path / "storage"))
    config = RunConfig(run=RUN, model="tiny-qwen3", input="in.jsonl", format="auto",
                       prompt_field=None, shard_size=6, limit=None, mode="online")
    storage.put_once(keys.run_config(RUN), dumps(config.to_json()))
    session = session_for(tiny, plan)
    rows = [random_row(120 + 20 * i, seed=i, name=f"r{i}") for i in range(6)]
    note_shard(session.ledger, 0, len(rows), 2)
    revise_schedule(ctx, session, RunStore(storage, RUN), config, "shard 0 read")
    assert session.pace.steps_per_epoch == 3
    for first in range(0, len(rows), 2):
        train_step(ctx, session, config, rows[first:first + 2], ShardTask(RUN, 0))
    status = StatusReader(storage, redis_server.client(), RUN).read()
    train = status["downstream"]["train"]
    planned, measured = session.pace.hours()
    assert session.pace.steps == 2 and measured is not None and measured > 0
    assert train["epoch_hours_measured"] == pytest.approx(measured, rel=1e-3)
    text = render_status(status)
    if plan:
        assert planned is not None
        lengths = [RowLength(len(r.input_ids), r.supervised_tokens) for r in rows[2:]]
        assert session.plan is not None
        expected = session.plan.rows_flops(lengths) / 1e9 * 3 / 2 / 3600
        assert planned == pytest.approx(expected, rel=1e-9)
        assert train["epoch_hours_planned"] == pytest.approx(planned, rel=1e-3)
        assert f"the plan {train['epoch_hours_planned']:.3g} h" in text
        assert "measured/plan" in text
    else:
        assert planned is None and train["epoch_hours_planned"] is None
        assert "no plan on the CPU" in text
    assert f"  epoch   {train['epoch_hours_measured']:.3g} h at the measured steps' pace" in text
    assert math.isfinite(train["epoch_hours_measured"])

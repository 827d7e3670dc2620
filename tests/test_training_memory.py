"""Training memory at the user's lengths, on the tiny targets: the capture keeps K layers, not
every layer's states; micro-batches give the one-batch update; and each kernel-independent term of
the memory plan (:mod:`common.plan`) matches what the real tensors hold, counted op by op
(:class:`embedded.memtrack.LiveBytes`) at four lengths."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from common.errors import NothingToTrain
from common.plan.memory import Device, Micro, StepMemory, features_bytes, target_transient_bytes
from common.plan.shapes import DrafterDims, TargetDims
from common.runs.trainrows import TrainingRow
from embedded.memtrack import LiveBytes
from tests.conftest import TinyTarget
from tests.tolerance import assert_close
from workers.capture import LayerCapture
from workers.train.drafter.features import target_features
from workers.train.drafter.model import DFlashDraftModel, add_mask_token
from workers.train.drafter.target_loader import load_target
from workers.train.drafter.train import DrafterTrainer, TrainConfig

LENGTHS = (300, 700, 1500, 3000)
# The plan counts the tensors each op keeps; the CPU's kernels keep a few more small ones (the
# norms' rsqrt, indices): within this share of the measured bytes.
PLAN_REL = 0.10
LAYERS = (1, 3, 5, 7)          # the last layer too: HF gives it after the final norm
CPU = Device(cuda=False)


@dataclass(frozen=True)
class Tiny:
    target: torch.nn.Module
    mask_id: int
    dims: TargetDims

    def drafter(self, seed: int = 0, **shape: int) -> DFlashDraftModel:
        return DFlashDraftModel.for_target(self.target, self.mask_id, init_seed=seed, **shape)

    def trainer(self, budget: int = 0, seed: int = 0, anchors: int = 64,
                chunk: int = 0) -> DrafterTrainer:
        drafter = self.drafter(seed)
        featurize = functools.partial(target_features, self.target,
                                      layer_ids=drafter.config.target_layer_ids)
        return DrafterTrainer(drafter, TrainConfig(total_steps=10, max_anchors=anchors,
                                                   logits_chunk=chunk), featurize, budget)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(target_model: TinyTarget, one_thread: None) -> Tiny:
    target, tokenizer = load_target(target_model.path)
    mask_id = add_mask_token(tokenizer, target)
    target.requires_grad_(False)
    return Tiny(target, mask_id, TargetDims.of_model(target))


def random_row(tokens: int, seed: int, prompt: int = 16, name: str = "r") -> TrainingRow:
    ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(seed))
    return TrainingRow(name, 0, ids.tolist(), [0] * prompt + [1] * (tokens - prompt))


def test_capture_keeps_the_k_layers_hf_gives_and_nothing_else(tiny: Tiny) -> None:
    """The hooks' features equal HF's ``output_hidden_states[i + 1]`` (the last layer's after
    the final norm); the capture keeps K x T x H, where HF's states keep (L + 1) x T x H."""
    width, hidden = 1500, tiny.dims.shape.hidden_size
    ids = torch.tensor([random_row(width, 0).input_ids])
    with torch.no_grad(), LiveBytes() as kept:
        features = LayerCapture(tiny.target, LAYERS).features(input_ids=ids, use_cache=False)
        captured = kept.settle()
    with torch.no_grad(), LiveBytes() as all_states:
        out = tiny.target(input_ids=ids, use_cache=False, output_hidden_states=True)
        everything = all_states.settle()
    expected = torch.cat([out.hidden_states[i + 1] for i in LAYERS], dim=-1)
    assert_close(features, expected, 1e-6, "captured features")
    assert captured == len(LAYERS) * width * hidden * 4
    states = tiny.dims.shape.num_layers + 1
    assert everything >= states * width * hidden * 4 > 2 * captured


def test_micro_batches_and_checkpointing_give_the_one_batch_update(tiny: Tiny) -> None:
    """One step over rows of mixed lengths: in one batch, in micro-batches of at most 600
    tokens (several), and with every layer recomputed; the same loss and parameters after."""
    rows = [random_row(n, seed, name=f"r{seed}") for seed, n in
            enumerate((520, 90, 310, 260, 140, 75))]
    whole, parts, recomputed = tiny.trainer(), tiny.trainer(budget=600), tiny.trainer()
    recomputed.checkpointing = lambda part: True
    drawn, _ = parts.draw(rows, torch.Generator().manual_seed(0))
    from workers.train.drafter.microbatch import micro_batches

    assert len(micro_batches(drawn, 600, 16)) >= 3
    metrics = [t.step(rows) for t in (whole, parts, recomputed)]
    assert metrics[1].loss == pytest.approx(metrics[0].loss, rel=1e-5)
    assert metrics[2].loss == pytest.approx(metrics[0].loss, rel=1e-5)
    assert metrics[1].tokens == metrics[0].tokens and metrics[1].labels == metrics[0].labels
    reference = whole.drafter.state_dict()
    for other in (parts, recomputed):
        for name, value in other.drafter.state_dict().items():
            assert_close(value, reference[name], 1e-4, name)
    assert any(not torch.equal(v, tiny.drafter().state_dict()[k]) for k, v in reference.items())


def test_an_out_of_memory_step_retries_at_half_the_budget_for_the_shard(
        tiny: Tiny, caplog: pytest.LogCaptureFixture) -> None:
    """The step retries at half the budget with checkpointing on; the next step keeps both, a
    new shard restores them; rows that fail alone twice are set aside, never retried forever."""
    trainer = tiny.trainer(budget=2000, anchors=8)   # 4 rows of 400: one micro-batch
    inner = trainer.featurize
    sizes: list[int] = []

    def featurize(rows: list[TrainingRow]) -> list[torch.Tensor]:
        padded = len(rows) * max(len(r.input_ids) for r in rows)
        sizes.append(padded)
        if padded > 1000:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return inner(rows)

    trainer.featurize = featurize
    rows = [random_row(400, seed, name=f"r{seed}") for seed in range(4)]
    with caplog.at_level(logging.WARNING):
        metrics = trainer.step(rows)
    assert metrics.rows == 4 and max(sizes) > 1000 and max(sizes[1:]) <= 1000
    assert "retrying the step at 1000 tokens with activation checkpointing on" in caplog.text
    assert (trainer.oom.retries, trainer.batch_tokens, trainer.oom.recompute) == (1, 1000, True)
    sizes.clear()
    trainer.oom.new_step()
    assert trainer.step(rows).rows == 4 and max(sizes) <= 1000 and trainer.oom.retries == 0
    trainer.oom.restore()
    assert (trainer.batch_tokens, trainer.oom.recompute) == (2000, False)
    trainer.featurize = lambda rows: (_ for _ in ()).throw(torch.OutOfMemoryError("again"))
    with pytest.raises(NothingToTrain):
        trainer.step(rows)
    assert trainer.oom.set_aside == 4 and trainer.oom.retries <= 4 * 2 + 3


def test_planned_weights_and_drafter_state_are_the_real_ones(tiny: Tiny, target_model: TinyTarget
                                                             ) -> None:
    """The target's parameters from a meta-device build of its config.json alone, and the
    drafter's state (weights, gradients, AdamW moments) after a real step."""
    loaded = TargetDims.load(target_model.path)
    assert loaded.params == sum(p.numel() for p in tiny.target.parameters())
    trainer = tiny.trainer()
    trainer.step([random_row(200, 0)])
    dims = DrafterDims.from_config(trainer.drafter.config)
    params = list(trainer.drafter.parameters())
    state = sum(t.numel() * t.element_size() for p in params
                for t in (p, p.grad if p.grad is not None else torch.zeros_like(p),
                          *(v for v in trainer.optimizer.state[p].values() if v.dim())))
    assert dims.params == sum(p.numel() for p in params)
    assert StepMemory.of(tiny.dims, dims, Micro.row(200), CPU, False).drafter_state == state
    for shape in ({"num_hidden_layers": 2}, {"num_hidden_layers": 3, "num_features": 3}):
        drafter = tiny.drafter(**shape)
        assert DrafterDims.from_config(drafter.config).params == sum(
            p.numel() for p in drafter.parameters())


@pytest.mark.parametrize("tokens", LENGTHS)
def test_planned_features_and_target_forward_match_the_tensors(tiny: Tiny, target_model: TinyTarget,
                                                               tokens: int) -> None:
    """Features exactly; the target forward's peak within PLAN_REL on the dense target (the
    hybrid's Gated DeltaNet layers run transformers' torch fallback here, not fla's kernels
    the plan counts: there the planned MLP peak is a lower bound)."""
    dims = DrafterDims.of(tiny.dims.shape, layer_ids=LAYERS)
    row = random_row(tokens, tokens)
    with torch.no_grad(), LiveBytes() as live:
        features = target_features(tiny.target, [row], LAYERS)
        kept = live.settle()
    assert kept == features_bytes(tiny.dims, dims, tokens) == features[0].numel() * 4
    planned = target_transient_bytes(tiny.dims, Micro.row(tokens)) + kept
    if target_model.hybrid:
        shape = tiny.dims.shape
        assert 3 * tokens * shape.intermediate_size * 4 + kept < live.peak
    else:
        assert planned == pytest.approx(live.peak, rel=PLAN_REL)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("chunk", [0, 256], ids=["logits-kept", "logits-recomputed"])
def test_planned_drafter_step_matches_the_tensors(tiny: Tiny, checkpointing: bool,
                                                  chunk: int) -> None:
    """The drafter step's peak (forward's saved tensors plus the backward's own) at four
    lengths, with and without activation checkpointing and logits recomputation."""
    trainer = tiny.trainer(chunk=chunk)
    trainer.drafter.checkpointing = checkpointing
    dims = DrafterDims.from_config(trainer.drafter.config)
    for tokens in LENGTHS:
        drawn, _ = trainer.draw([random_row(tokens, tokens)])
        batch = trainer.pack(drawn)
        trainer.drafter.checkpointing = checkpointing
        micro = Micro(1, tokens, tokens, batch.blocks * batch.block_size, int(batch.valid.sum()))
        planned = StepMemory.of(tiny.dims, dims, micro, CPU, checkpointing, chunk or None)
        for p in trainer.drafter.parameters():   # gradients exist: the state's, not the step's
            p.grad = torch.zeros_like(p)
        with LiveBytes() as live:
            loss, _ = trainer.forward_sum(batch)
            loss.backward()
        assert planned.drafter_activations == pytest.approx(live.peak, rel=PLAN_REL), tokens

"""Online DFlash training: one optimizer step per batch of rows with their target features.

    drafter = DFlashDraftModel.for_target(target, add_mask_token(tokenizer, target))
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=10_000))
    for rows in batches:
        metrics = trainer.step(with_target_features(target, rows, drafter.config.target_layer_ids))
        log.info("%s", metrics.summary())
    torch.save(trainer.state_dict(), "ckpt.pt")          # drafter, optimizer, schedule, step, RNG
    trainer.load_state_dict(torch.load("ckpt.pt"))      # a resumed trainer continues identically
    trainer = DrafterTrainer.from_state_dict(torch.load("ckpt.pt"), target)   # or from scratch

Each step: rows with fewer than ``min_supervised_tokens`` (default ``2 * block_size``)
supervised tokens are skipped; up to
``max_anchors`` anchors per row are drawn from the trainer's own seeded generator; rows are
packed (:mod:`.blocks`); the loss is the slot-weighted mean cross-entropy; AdamW
with a warmup + cosine schedule and gradient clipping updates the drafter. Metrics are read back
with one device sync per step. On CUDA the step runs under bf16 autocast with flex attention.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from common.errors import NothingToTrain
from workers.train.drafter.blocks import (
    PackedBatch,
    acceptance_length,
    pack_rows,
    sample_anchors,
    slot_weights,
)
from workers.train.drafter.features import FeaturedRow
from workers.train.drafter.masks import dense_block_mask, flex_available, flex_block_mask
from workers.train.drafter.model import DFlashConfig, DFlashDraftModel
from workers.train.drafter.schedule import Schedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule and sampling settings of drafter training (the DFlash recipe's)."""

    total_steps: int
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    max_anchors: int = 512
    loss_gamma: float = 7.0
    seed: int = 0
    attention: str = "auto"          # auto (flex on CUDA, else dense SDPA) | flex | sdpa
    logits_chunk: int = 8192         # labels whose vocab logits exist at once (rest recomputed)
    min_supervised_tokens: int = 0   # shorter rows are skipped; 0: two blocks (2 x block size)

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_ratio * self.total_steps))

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be positive, not {self.total_steps}")
        if self.attention not in ("auto", "flex", "sdpa"):
            raise ValueError(f"attention must be auto, flex or sdpa, not {self.attention!r}")


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    return Schedule(warmup, total).factor(step)


@dataclass(frozen=True)
class StepMetrics:
    """What one step did and how well the drafter predicts (slot k = k-th drafted token)."""

    step: int
    loss: float
    slot_accuracy: tuple[float, ...]   # slots 1..B-1; NaN where a slot had no label
    lr: float
    grad_norm: float
    rows: int
    skipped_rows: int
    blocks: int
    labels: int
    tokens: int
    seconds: float

    @property
    def acceptance_length(self) -> float:
        """Estimated tokens per verify step (see :func:`blocks.acceptance_length`)."""
        return acceptance_length(self.slot_accuracy)

    @property
    def tokens_per_s(self) -> float:
        """Context tokens (row lengths) trained on per second of step wall time."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (f"step {self.step} loss {self.loss:.4f} acc1 {self.slot_accuracy[0]:.3f} "
                f"tau {self.acceptance_length:.2f} lr {self.lr:.2e} "
                f"{self.tokens_per_s:.0f} tok/s ({self.rows} rows, {self.skipped_rows} skipped)")


class DrafterTrainer:
    """Drafter + AdamW + schedule + anchor RNG: ``step(rows)`` trains, ``state_dict`` resumes."""

    featurizes = False   # its steps take rows with the target's features computed

    def __init__(self, drafter: DFlashDraftModel, config: TrainConfig) -> None:
        self.drafter = drafter
        self.module: nn.Module = drafter   # what forward runs: the drafter or its DDP replica
        self.config = config
        self.device = drafter.fc.weight.device
        self.block_size = drafter.config.block_size
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=config.lr, betas=config.betas,
            weight_decay=config.weight_decay, fused=self.device.type == "cuda")
        # The learning rate of every step comes from here: revisable without a jump.
        self.schedule = Schedule(config.warmup_steps, config.total_steps)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.steps = 0
        self.weights = slot_weights(self.block_size, config.loss_gamma).to(self.device)
        use_flex = config.attention == "flex" or (
            config.attention == "auto" and flex_available(self.device))
        self.attention = "flex" if use_flex else "sdpa"
        # A block needs an anchor and one supervised token after it.
        self.min_supervised = max(2, config.min_supervised_tokens or 2 * self.block_size)

    def prepare(self, rows: Sequence[FeaturedRow],
                generator: torch.Generator | None = None) -> tuple[PackedBatch | None, int]:
        """Skip short rows, draw anchors, pack: ``(batch or None, skipped rows)``."""
        keep = [r for r in rows if r.row.supervised_tokens >= self.min_supervised]
        if not keep:
            return None, len(rows)
        gen = generator or self.generator
        anchors = [sample_anchors(torch.tensor(r.row.loss_mask), self.config.max_anchors, gen)
                   for r in keep]
        batch = pack_rows([r.row for r in keep], [r.features for r in keep], anchors,
                          self.block_size, self.drafter.config.mask_token_id)
        return batch.to(self.device), len(rows) - len(keep)

    def attn_mask(self, batch: PackedBatch) -> Any:
        """The dense or flex attention mask of a packed batch: one per attention kind of the
        drafter's layers (full or sliding window, bidirectional or causal in the block)."""
        masks = {}
        for window, causal in self.drafter.config.attention_kinds:
            if self.attention == "flex":
                masks[window, causal] = flex_block_mask(
                    batch.anchors, batch.starts, batch.tokens, self.block_size, self.device,
                    window, causal)
            else:
                masks[window, causal] = dense_block_mask(
                    batch.anchors, batch.starts, batch.tokens, self.block_size, window, causal)
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def forward(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted loss and a ``[2, B]`` tensor: correct and labelled counts per slot."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            hidden = self.module(batch.block_ids[None], batch.block_positions[None],
                                 batch.features[None], batch.context_positions[None],
                                 self.attn_mask(batch))[0]
            hidden = hidden.view(batch.blocks, self.block_size, -1)[batch.valid]
            labels = batch.labels[batch.valid]
            slots = batch.valid.nonzero()[:, 1]
            weights = self.weights[slots]
            chunk = self.config.logits_chunk
            parts = [self._chunk_loss(hidden[i:i + chunk], labels[i:i + chunk],
                                      weights[i:i + chunk], recompute=labels.numel() > chunk)
                     for i in range(0, labels.numel(), chunk)]
        loss = torch.stack([p[0] for p in parts]).sum() / weights.sum()
        with torch.no_grad():
            correct = torch.cat([p[1] for p in parts]).float()
            per_slot = torch.zeros(2, self.block_size, device=self.device)
            per_slot[0].index_add_(0, slots, correct)
            per_slot[1].index_add_(0, slots, torch.ones_like(correct))
        return loss, per_slot

    def _chunk_loss(self, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                    recompute: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted CE sum and hits of one chunk; ``recompute`` frees its logits until backward."""
        def run(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.drafter.logits(h).float()
            ce = F.cross_entropy(logits, labels, reduction="none")
            return (ce * weights).sum(), logits.argmax(-1) == labels

        if recompute and torch.is_grad_enabled():
            return checkpoint(run, hidden, use_reentrant=False)
        return run(hidden)

    def _metrics(self, batch: PackedBatch, skipped: int, loss: torch.Tensor,
                 per_slot: torch.Tensor, grad_norm: torch.Tensor, lr: float,
                 started: float) -> StepMetrics:
        stats = torch.cat([loss.detach().reshape(1), grad_norm.reshape(1).float(),
                           per_slot.flatten()]).tolist()   # the step's one device sync
        correct, totals = stats[2:2 + self.block_size], stats[2 + self.block_size:]
        accuracy = tuple(c / t if t else float("nan")
                         for c, t in zip(correct[1:], totals[1:], strict=True))
        return StepMetrics(step=self.steps, loss=stats[0], slot_accuracy=accuracy, lr=lr,
                           grad_norm=stats[1], rows=batch.rows, skipped_rows=skipped,
                           blocks=batch.blocks, labels=int(sum(totals)), tokens=batch.tokens,
                           seconds=time.perf_counter() - started)

    def step(self, rows: Sequence[FeaturedRow]) -> StepMetrics:
        """One optimizer step on ``rows``; raises NothingToTrain when every row is too short."""
        started = time.perf_counter()
        batch, skipped = self.prepare(rows)
        if batch is None:
            raise NothingToTrain(f"all {skipped} rows have < {self.min_supervised} "
                                 "supervised tokens")
        self.drafter.train()
        loss, per_slot = self.forward(batch)
        loss.backward()
        grad_norm, lr = self.optimizer_step()
        return self._metrics(batch, skipped, loss, per_slot, grad_norm, lr, started)

    def optimizer_step(self) -> tuple[torch.Tensor, float]:
        """After backward, one rank's or the group's: clip, step, schedule, clear the gradients;
        returns the pre-clip gradient norm and the learning rate the step used."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(),
                                                   self.config.grad_clip)
        if isinstance(grad_norm, DTensor):   # FSDP2: already reduced, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        lr = self.config.lr * self.schedule.factor(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return grad_norm, lr

    @torch.no_grad()
    def evaluate(self, rows: Sequence[FeaturedRow], seed: int = 0) -> StepMetrics:
        """Loss and slot accuracies on ``rows`` without training (its own anchor RNG)."""
        started = time.perf_counter()
        batch, skipped = self.prepare(rows, torch.Generator().manual_seed(seed))
        if batch is None:
            raise NothingToTrain(f"all {skipped} rows are too short to evaluate")
        self.drafter.eval()
        loss, per_slot = self.forward(batch)
        return self._metrics(batch, skipped, loss, per_slot, torch.zeros(()), 0.0, started)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed trainer needs; tensors are live, so save (or copy) it at once."""
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.to_json(),
            "steps": self.steps,
            "rng": self.generator.get_state(),
            "train_config": asdict(self.config),
            "drafter_config": asdict(self.drafter.config),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], target: nn.Module) -> DrafterTrainer:
        """Rebuild a trainer from :meth:`state_dict` alone, on ``target``'s embedding and head."""
        drafter_config = dict(state["drafter_config"])
        train_config = dict(state["train_config"])
        train_config["betas"] = tuple(train_config["betas"])
        embed = target.get_input_embeddings()
        drafter = DFlashDraftModel(DFlashConfig(**drafter_config), embed,
                                   target.get_output_embeddings()).to(embed.weight.device)
        trainer = cls(drafter, TrainConfig(**train_config))
        trainer.load_state_dict(state)
        return trainer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (built with the same configs; adopts its tensors)."""
        if state["train_config"] != asdict(self.config):
            log.warning("resuming with a different train config: %s -> %s",
                        state["train_config"], asdict(self.config))
        if DFlashConfig(**state["drafter_config"]) != self.drafter.config:
            raise ValueError("the checkpoint was trained for a different drafter config")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule = Schedule.from_json(state["schedule"])
        self.steps = int(state["steps"])
        self.generator.set_state(state["rng"])

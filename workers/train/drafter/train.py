"""Online DFlash training: one optimizer step per batch of rows, in micro-batches.

    drafter = DFlashDraftModel.for_target(target, add_mask_token(tokenizer, target))
    featurize = partial(target_features, target, layer_ids=drafter.config.target_layer_ids)
    trainer = DrafterTrainer(drafter, TrainConfig(total_steps=10_000), featurize, 16384)
    for rows in batches:           # plain rows (features per micro-batch) or FeaturedRow
        metrics = trainer.step(rows)
        log.info("%s", metrics.summary())
    torch.save(trainer.state_dict(), "ckpt.pt")          # drafter, optimizer, schedule, step, RNG
    trainer.load_state_dict(torch.load("ckpt.pt"))      # a resumed trainer continues identically
    trainer = DrafterTrainer.from_state_dict(torch.load("ckpt.pt"), target)   # or from scratch

Each step: rows with fewer than ``min_supervised_tokens`` (default ``2 * block_size``)
supervised tokens are skipped; up to
``max_anchors`` anchors per row are drawn from the trainer's own seeded generator; the rows go
through the target and the drafter in micro-batches under ``batch_tokens``
(:mod:`.microbatch`), each packed (:mod:`.blocks`), gradients accumulated to the one-batch
update; the loss is the slot-weighted mean cross-entropy; AdamW
with a warmup + cosine schedule and gradient clipping updates the drafter. Metrics are read back
with one device sync per step. On CUDA the step runs under bf16 autocast with flex attention.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from common.choices import Attention
from common.errors import NothingToTrain
from common.faults import inject
from common.plan.memory import logits_chunk_for
from common.runs.trainrows import TrainingRow
from workers.target_heads import input_embedding, output_head
from workers.train.drafter.blocks import (
    PackedBatch,
    pack_rows,
    sample_anchors,
    slot_weights,
)
from workers.train.drafter.config import DFlashConfig
from workers.train.drafter.features import FeaturedRow, TrainRow, plain_row
from workers.train.drafter.masks import batch_masks, flex_available
from workers.train.drafter.microbatch import (
    NO_BUDGET,
    Accumulated,
    Drawn,
    OutOfMemory,
    label_weight,
    micro_batches,
)
from workers.train.drafter.model import DFlashDraftModel
from workers.train.drafter.recipe import (  # noqa: F401 - re-exported
    StepMetrics,
    TrainConfig,
    lr_factor,
)
from workers.train.drafter.schedule import Schedule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Featurize = Callable[[list[TrainingRow]], list[torch.Tensor]]

log = logging.getLogger(__name__)


class DrafterTrainer:
    """Drafter + AdamW + schedule + anchor RNG: ``step(rows)`` trains, ``state_dict`` resumes."""

    def __init__(self, drafter: DFlashDraftModel, config: TrainConfig,
                 featurize: Featurize | None = None, batch_tokens: int = NO_BUDGET) -> None:
        self.drafter = drafter
        # The target's features of plain rows (stored rows bring theirs), per micro-batch.
        self.featurize = featurize
        # Padded target tokens and draft positions a micro-batch may hold (0: the whole step),
        # halved after an out-of-memory step for the rest of the shard.
        self.oom = OutOfMemory()
        self.oom.configure(batch_tokens)
        self.failed: Sequence[Drawn] | None = None   # the micro-batch that last raised
        # A GPU plan's check that a micro-batch's drafter step fits what is free (a group's
        # FSDP2 ranks run it before their forward: workers.train.memory.headroom_check).
        self.headroom: Callable[[Sequence[Drawn], bool], None] | None = None
        # Whether a micro-batch recomputes the drafter's layers in the backward (the memory
        # plan's call under auto: workers.train.memory).
        self.checkpointing: Callable[[Sequence[Drawn]], bool] = lambda part: False
        self.module: nn.Module = drafter   # what forward runs (the drafter; FSDP2 shards it)
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
        use_flex = config.attention is Attention.FLEX or (
            config.attention is Attention.AUTO and flex_available(self.device))
        self.attention = Attention.FLEX if use_flex else Attention.SDPA
        # A block needs an anchor and one supervised token after it.
        self.min_supervised = max(2, config.min_supervised_tokens or 2 * self.block_size)

    @property
    def batch_tokens(self) -> int:
        return self.oom.current

    @batch_tokens.setter
    def batch_tokens(self, tokens: int) -> None:
        self.oom.configure(tokens)

    def prepare(self, rows: Sequence[FeaturedRow],
                generator: torch.Generator | None = None) -> tuple[PackedBatch | None, int]:
        """Skip short rows, draw anchors, pack: ``(batch or None, skipped rows)``."""
        drawn, skipped = self.draw(rows, generator)
        if not drawn:
            return None, skipped
        return self.pack(drawn), skipped

    def draw(self, rows: Sequence[TrainRow],
             generator: torch.Generator | None = None) -> tuple[list[Drawn], int]:
        """The rows long enough to train, each with its anchors (drawn in row order, so a step
        draws what one batch would); and how many rows were too short."""
        keep = [r for r in rows if plain_row(r).supervised_tokens >= self.min_supervised]
        gen = generator or self.generator
        drawn = [Drawn(r, sample_anchors(torch.tensor(plain_row(r).loss_mask),
                                         self.config.max_anchors, gen)) for r in keep]
        return drawn, len(rows) - len(keep)

    def pack(self, drawn: Sequence[Drawn]) -> PackedBatch:
        """One micro-batch on the device: its rows' features (stored, or computed now by the
        target through :attr:`featurize`), blocks and labels."""
        rows = [d.row for d in drawn]
        self.drafter.checkpointing = self.oom.recompute or self.checkpointing(drawn)
        featured = [r for r in rows if isinstance(r, FeaturedRow)]
        if len(featured) == len(rows):
            features = [r.features for r in featured]
        elif self.featurize is None:
            raise TypeError("rows without features, and no featurize to compute them")
        else:
            features = self.featurize([plain_row(r) for r in rows])
        batch = pack_rows([plain_row(r) for r in rows], features, [d.anchors for d in drawn],
                          self.block_size, self.drafter.config.mask_token_id)
        return batch.to(self.device)

    def forward(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted loss and a ``[2, B]`` tensor: correct and labelled counts per slot."""
        loss_sum, per_slot = self.forward_sum(batch)
        return loss_sum / self.weights[batch.valid.nonzero()[:, 1]].sum(), per_slot

    def masks(self, batch: PackedBatch) -> Any:
        """The micro-batch's attention masks (flex's build evaluates the whole grid once)."""
        return batch_masks(self.drafter.config, batch, self.device,
                           self.attention is Attention.FLEX)

    def forward_sum(self, batch: PackedBatch,
                    masks: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted cross-entropy *sum* (a micro-batch's share of the step's loss) and a
        ``[2, B]`` tensor: correct and labelled counts per slot (``masks``: built now if None)."""
        masks = self.masks(batch) if masks is None else masks
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            hidden = self.module(batch.block_ids[None], batch.block_positions[None],
                                 batch.features[None], batch.context_positions[None],
                                 masks)[0]
            hidden = hidden.view(batch.blocks, self.block_size, -1)[batch.valid]
            labels = batch.labels[batch.valid]
            slots = batch.valid.nonzero()[:, 1]
            weights = self.weights[slots]
            chunk = self.config.logits_chunk or logits_chunk_for(self.drafter.config.vocab_size)
            parts = [self._chunk_loss(hidden[i:i + chunk], labels[i:i + chunk],
                                      weights[i:i + chunk], recompute=labels.numel() > chunk)
                     for i in range(0, labels.numel(), chunk)]
        loss = torch.stack([p[0] for p in parts]).sum()
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
            recomputed: tuple[torch.Tensor, torch.Tensor] = checkpoint(run, hidden,
                                                                       use_reentrant=False)
            return recomputed
        return run(hidden)

    def _metrics(self, done: Accumulated, skipped: int, total: torch.Tensor,
                 grad_norm: torch.Tensor, lr: float, started: float) -> StepMetrics:
        assert done.loss_sum is not None and done.per_slot is not None
        loss = done.loss_sum / total
        stats = torch.cat([loss.detach().reshape(1), grad_norm.reshape(1).float(),
                           done.per_slot.flatten()]).tolist()   # the step's one device sync
        correct, totals = stats[2:2 + self.block_size], stats[2 + self.block_size:]
        accuracy = tuple(c / t if t else float("nan")
                         for c, t in zip(correct[1:], totals[1:], strict=True))
        return StepMetrics(step=self.steps, loss=stats[0], slot_accuracy=accuracy, lr=lr,
                           grad_norm=stats[1], rows=done.rows, skipped_rows=skipped,
                           blocks=done.blocks, labels=int(sum(totals)), tokens=done.tokens,
                           seconds=time.perf_counter() - started)

    def step(self, rows: Sequence[TrainRow]) -> StepMetrics:
        """One optimizer step on ``rows`` (with features, or computed per micro-batch through
        :attr:`featurize`); raises NothingToTrain when every row is too short. A micro-batch out
        of memory retries the step (:class:`OutOfMemory`: half the budget, checkpointing on)."""
        started = time.perf_counter()
        drawn, skipped = self.draw(rows)
        if not drawn:
            raise NothingToTrain(f"all {skipped} rows have < {self.min_supervised} "
                                 "supervised tokens")
        self.drafter.train()
        self.oom.new_step()
        while True:
            total = label_weight(drawn, self.weights, self.block_size)
            try:
                done = self.accumulate(micro_batches(drawn, self.batch_tokens, self.block_size),
                                       total)
                break
            except torch.OutOfMemoryError:
                drawn = self.after_out_of_memory(drawn, self.failed)
        grad_norm, lr = self.optimizer_step()
        return self._metrics(done, skipped, total, grad_norm, lr, started)

    def accumulate(self, parts: Sequence[Sequence[Drawn]], total: torch.Tensor,
                   sync: Callable[[bool], Any] | None = None) -> Accumulated:
        """Forward and backward of each micro-batch, its loss over the step's label weight
        ``total``; ``sync(last)`` wraps each backward (DDP: gradients reduced on the last)."""
        done = Accumulated()
        for index, part in enumerate(parts):
            self.failed = part
            inject("train.forward.rank0")
            batch = self.pack(part)
            loss_sum, per_slot = self.forward_sum(batch)
            inject("train.backward.rank0")
            with sync(index == len(parts) - 1) if sync else contextlib.nullcontext():
                (loss_sum / total).backward()
            done.add(loss_sum, per_slot, batch)
            del batch, loss_sum
        self.failed = None
        return done

    def after_out_of_memory(self, drawn: list[Drawn],
                            failed: Sequence[Drawn] | None) -> list[Drawn]:
        """Free what the step holds (gradients, the allocator's cache); the rows to retry."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.oom.retry(drawn, failed, self.steps + 1)

    def eval_drafter(self) -> DFlashDraftModel:
        """The drafter the acceptance-length eval decodes with: this one."""
        return self.drafter

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
        loss_sum, per_slot = self.forward_sum(batch)
        done = Accumulated()
        done.add(loss_sum, per_slot, batch)
        total = self.weights[batch.valid.nonzero()[:, 1]].sum()
        return self._metrics(done, skipped, total, torch.zeros(()), 0.0, started)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed trainer needs; tensors are live, so save (or copy) it at once."""
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.to_json(),
            "steps": self.steps,
            "rng": self.generator.get_state(),
            "train_config": self.config.to_json(),
            "drafter_config": asdict(self.drafter.config),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], target: PreTrainedModel) -> DrafterTrainer:
        """Rebuild a trainer from :meth:`state_dict` alone, on ``target``'s embedding and head."""
        drafter_config = dict(state["drafter_config"])
        train_config = dict(state["train_config"])
        train_config["betas"] = tuple(train_config["betas"])
        embed = input_embedding(target)
        drafter = DFlashDraftModel(DFlashConfig(**drafter_config), embed,
                                   output_head(target)).to(embed.weight.device)
        trainer = cls(drafter, TrainConfig(**train_config))
        trainer.load_state_dict(state)
        return trainer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (built with the same configs; adopts its tensors)."""
        if state["train_config"] != self.config.to_json():
            log.warning("resuming with a different train config: %s -> %s",
                        state["train_config"], self.config.to_json())
        if DFlashConfig(**state["drafter_config"]) != self.drafter.config:
            raise ValueError("the checkpoint was trained for a different drafter config")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule = Schedule.from_json(state["schedule"])
        self.steps = int(state["steps"])
        self.generator.set_state(state["rng"])

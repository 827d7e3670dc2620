"""The drafter training recipe's settings and what one step reports.

    config = TrainConfig(total_steps=10_000)       # AdamW 6e-4, warmup 4%, cosine, clip 1.0
    metrics.summary()                              # "step 12 loss 3.2 acc1 0.41 tau 1.8 ..."
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from common.choices import Attention
from workers.train.drafter.blocks import acceptance_length
from workers.train.drafter.schedule import Schedule


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
    attention: Attention = Attention.AUTO   # auto: flex on CUDA, else dense SDPA
    # Labels whose vocab logits exist at once (the rest recomputed); 0: 1 GiB of float32 logits
    # (common.plan.memory.logits_chunk_for), 1,081 labels for a 248K vocabulary.
    logits_chunk: int = 0
    min_supervised_tokens: int = 0   # shorter rows are skipped; 0: two blocks (2 x block size)

    def to_json(self) -> dict[str, Any]:
        """The fields as plain data (a checkpoint loads with ``weights_only``: no enum)."""
        return {**asdict(self), "attention": self.attention.value}

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_ratio * self.total_steps))

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be positive, not {self.total_steps}")
        try:   # a member however it came (a checkpoint's JSON, a caller's text)
            object.__setattr__(self, "attention", Attention(self.attention))
        except ValueError:
            raise ValueError(f"attention must be auto, flex or sdpa, not {self.attention!r}") \
                from None


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

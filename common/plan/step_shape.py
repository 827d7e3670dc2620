"""The shape of a training step's memory plan: where it runs (:class:`Device`) and a
micro-batch's sizes (:class:`Micro`), which every term of :mod:`common.plan.memory` reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.choices import Attention

GiB = 2**30
FP32 = 4


@dataclass(frozen=True)
class Device:
    """Where and how the step runs: a GPU (bf16 target, bf16 autocast, flex attention, fla
    kernels) or the CPU (float32, dense attention masks); the parallel layout; the drafter's
    attention as ``TrainConfig.attention`` says (``sdpa`` on a GPU: bf16 with dense masks)."""

    cuda: bool = True
    ranks: int = 1
    fsdp: bool = False
    attention: Attention = Attention.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", Attention(self.attention))   # a caller's text too

    @property
    def act_bytes(self) -> int:
        """Bytes of a linear layer's output: bf16 under autocast, else float32."""
        return 2 if self.cuda else FP32

    @property
    def flex(self) -> bool:
        """Whether the drafter attends through flex attention (no dense mask is kept)."""
        return self.attention is Attention.FLEX or (self.attention is Attention.AUTO
                                                    and self.cuda)


@dataclass(frozen=True)
class Micro:
    """A micro-batch's shape: rows padded to ``width`` for the target, ``tokens`` real tokens of
    drafter context, ``queries`` draft positions (anchors x block), ``labels`` trained slots."""

    rows: int
    width: int
    tokens: int
    queries: int
    labels: int

    @property
    def padded(self) -> int:
        return self.rows * self.width

    @classmethod
    def row(cls, tokens: int, block_size: int = 16, max_anchors: int = 512,
            supervised: int | None = None) -> Micro:
        """One row alone: anchors on its supervised tokens (all of them unless given)."""
        anchors = min(max_anchors, max(0, (tokens if supervised is None else supervised) - 1))
        return cls(1, tokens, tokens, anchors * block_size, anchors * (block_size - 1))

    @classmethod
    def budget(cls, tokens: int, block_size: int = 16) -> Micro:
        """The worst micro-batch a budget admits: padded tokens and draft positions both at the
        budget (short rows, each an anchor per token), two rows padded to each other."""
        return cls(2, math.ceil(tokens / 2), tokens, tokens,
                   tokens * (block_size - 1) // block_size)

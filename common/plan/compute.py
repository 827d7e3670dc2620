"""FLOPs of an epoch of drafter training and the hours they take, from the rows' lengths.

    rows = [RowLength(tokens=4200, supervised=3900), ...]          # the run's committed rows
    flops = epoch_flops(target, drafter, rows, max_anchors=512)
    hours = flops / (num_gpus * gpu_tflops * 1e12 * utilization) / 3600

Per row of ``T`` tokens with ``A`` anchors (``Q = A x B`` draft positions): the target's
forward as the capture runs it (:mod:`workers.capture`): the embedding is a lookup (no matmul)
and the forward stops after the deepest layer the drafter reads (no later layer, no final norm,
no LM head), so ``2 x`` the parameters of layers ``0..deepest`` ``x T``, plus each of those
layers' full attention, ``2 x T^2 x q_width`` (causal; a Gated DeltaNet layer's state updates,
about 1% of its matmuls, are not counted); the drafter's forward, ``2 x`` the weights each
position passes (queries through every layer, context through the feature projection and each
layer's k/v projections) plus its attention (each block over its anchor's context, on average
half the row) and the logits of the trained slots; its backward twice its forward (the logits'
once: the LM head is frozen), and the logits' forward once more where a row's labels exceed one
chunk (the trainer frees them until the backward recomputes them); the layers' forward once
more with activation checkpointing. A row's own labels decide the recompute (rows packed into
one micro-batch past a chunk recompute too: uncounted, and rare at a large vocabulary, whose
chunk is a row of a few dozen anchors).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from common.plan.memory import logits_chunk_for
from common.plan.shapes import DrafterDims, TargetDims

# Dense bf16 tensor-core peaks (NVIDIA's data sheets, without sparsity) by a GPU name's part.
GPU_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0,
              "A800": 312.0, "L40S": 362.0, "L40": 181.0, "A10": 125.0, "L4": 121.0}
DEFAULT_TFLOPS = 989.0        # an H100's, where the GPU is not known
DEFAULT_UTILIZATION = 0.4     # of the peak, sustained (a training step of mixed kernels)


def gpu_tflops(name: str | None) -> float:
    """The bf16 peak of a GPU by its name (``NVIDIA H100 80GB HBM3``), else an H100's."""
    for part, tflops in GPU_TFLOPS.items():
        if name and part.lower() in name.lower():
            return tflops
    return DEFAULT_TFLOPS


@dataclass(frozen=True)
class RowLength:
    """A training row's length and its supervised (generated) tokens."""

    tokens: int
    supervised: int


def target_flops(target: TargetDims, tokens: int, deepest: int | None = None) -> float:
    """FLOPs of the capture's forward of one row: layers ``0..deepest`` (None: all of them)."""
    shape = target.shape
    layers = shape.num_layers if deepest is None else min(deepest + 1, shape.num_layers)
    full = sum(1 for i in shape.full_attention_layers if i < layers)
    q_width = (shape.num_attention_heads or 0) * (shape.head_dim or 0)
    return 2.0 * target.trunk_params(layers) * tokens + 2.0 * full * tokens * tokens * q_width


def drafter_flops(drafter: DrafterDims, row: RowLength, max_anchors: int,
                  checkpointing: bool = False, logits_chunk: int | None = None) -> float:
    """FLOPs of one row's drafter forward and backward (``logits_chunk``: the trainer's)."""
    t = row.tokens
    anchors = min(max_anchors, max(0, row.supervised - 1))
    q, b, h = anchors * drafter.block_size, drafter.block_size, drafter.hidden_size
    per_query = (2 * h * drafter.q_width + 3 * h * drafter.intermediate_size)
    per_key = 2 * h * drafter.kv_width
    layers = drafter.num_hidden_layers * (q * per_query + (q + t) * per_key)
    attention = drafter.num_hidden_layers * 2 * q * (t / 2 + b) * drafter.q_width
    labels = anchors * (b - 1)
    logits = 2.0 * labels * h * drafter.vocab_size   # one pass of the frozen LM head
    forward = 2.0 * (layers + t * drafter.num_features * h * h + attention)
    passes = 2 + (labels > (logits_chunk or logits_chunk_for(drafter.vocab_size)))
    drafter_f = 3 * forward + passes * logits   # forward, input gradient (and a recompute)
    if checkpointing:
        drafter_f += forward   # the layers run forward again in the backward
    return drafter_f


def row_flops(target: TargetDims, drafter: DrafterDims, row: RowLength, max_anchors: int,
              checkpointing: bool = False, logits_chunk: int | None = None,
              with_target: bool = True) -> float:
    """FLOPs of one row's target forward (unless its features are stored) and drafter step."""
    drafted = drafter_flops(drafter, row, max_anchors, checkpointing, logits_chunk)
    if not with_target:
        return drafted
    return target_flops(target, row.tokens, drafter.deepest_layer) + drafted


def epoch_flops(target: TargetDims, drafter: DrafterDims, rows: Iterable[RowLength],
                max_anchors: int, checkpointing: bool = False, with_target: bool = True) -> float:
    """FLOPs of one pass over ``rows`` (``with_target``: features computed, not stored)."""
    return sum(row_flops(target, drafter, r, max_anchors, checkpointing, None, with_target)
               for r in rows)


def hours(flops: float, num_gpus: int, tflops: float, utilization: float) -> float:
    """Wall hours of ``flops`` on ``num_gpus`` GPUs at ``utilization`` of ``tflops``."""
    return flops / (num_gpus * tflops * 1e12 * utilization) / 3600

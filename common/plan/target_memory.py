"""The target's forward over a micro-batch at its peak, beyond its weights and the features:
the memory plan's ``target_transient`` term (:mod:`common.plan.memory`)."""

from __future__ import annotations

import math

from common.plan.shapes import TargetDims
from common.plan.step_shape import FP32, Micro

GDN_CHUNK = 64               # fla's chunk length in the Gated DeltaNet kernels


def target_transient_bytes(target: TargetDims, micro: Micro) -> int:
    """The target's forward over the micro-batch at its peak, beyond weights and features."""
    shape, a, p = target.shape, target.dtype_bytes, micro.padded
    h, head = shape.hidden_size, shape.head_dim or 0
    heads, kv = (shape.num_attention_heads or 0), (shape.num_key_value_heads or 0)
    # Embedding output (kept by the model's forward), residual, normed input, the layer's output;
    # the rotary tables.
    streams = 4 * p * h * a + 2 * p * head * a
    widest = 3 * p * (shape.intermediate_size or 0) * a        # gate/act, up, their product
    widest = max(widest, p * (3 * heads * head + 2 * kv * head) * a + p * heads * head * FP32)
    if shape.is_hybrid and target.linear is not None:
        widest = max(widest, gated_delta_net_bytes(target, p))
    mask = micro.rows * micro.width ** 2 if micro.rows > 1 else 0   # SDPA's [R, 1, T, T] mask
    return streams + widest + mask


def gated_delta_net_bytes(target: TargetDims, p: int) -> int:
    """A Gated DeltaNet layer at its peak (fla 0.5's ``chunk_gated_delta_rule``, with native
    grouped values: transformers 5 passes q and k unrepeated), at its last kernel: the
    convolved q/k/v and the contiguous copies the kernel's ``input_guard`` makes of them, the
    l2-normalized q and k, z; the chunks' solved ``A`` (fused with the kkt product, in the
    input dtype), ``w``, ``u``, ``v_new`` and the output; the per-chunk states
    ``h [chunks, heads, dk, dv]``; a, b and beta, the gate and its chunk cumsum (float32)."""
    lin, a = target.linear, target.dtype_bytes
    assert lin is not None
    heads, q_k = lin.value_heads, lin.key_heads * lin.key_dim
    inputs = p * (2 * lin.conv_width + 2 * q_k + heads * lin.value_dim) * a
    chunk_a = p * heads * GDN_CHUNK * a
    work = p * heads * (lin.key_dim + 3 * lin.value_dim) * a
    states = math.ceil(p / GDN_CHUNK) * heads * lin.key_dim * lin.value_dim * a
    gates = p * heads * (3 * a + 2 * FP32) + p * 2 * lin.key_heads * FP32   # and the rstds
    return inputs + chunk_a + work + states + gates

"""Bytes per rank of a training step, term by term, from shapes alone (no GPU is spent).

    micro = Micro.row(32768)                                  # one 32K-token row, alone
    need = StepMemory.of(target, drafter, micro, Device())   # .target, .drafter_state, ...
    need.total                                               # bytes at the step's peak

The terms, each the tensors it counts (docs/guides/training.md, "Long traces and memory"):

- ``target``: the frozen target's weights, whole on every rank.
- ``drafter_state``: the drafter's float32 weights, gradients and AdamW moments (16 bytes a
  parameter), sharded over the ranks with FSDP2 (plus two layers gathered at a time).
- ``features``: the K captured layers of a micro-batch, ``K x tokens x H`` in the target's dtype.
- ``target_transient``: the target's forward of a micro-batch at its peak (no gradients): the
  residual streams, the widest layer's insides (the MLP, or a Gated DeltaNet layer and its
  chunked kernel's states) and, for several padded rows, the attention's padding mask.
- ``drafter_activations``: what the drafter's step keeps for its backward (every layer's
  tensors, or with activation checkpointing each layer's input and one layer rebuilt), the
  logits of one chunk and their gradient, and (with autocast, DDP) the weights' bf16 copies.

The target's forward ends before the drafter's step begins, so a step's peak is the resident
part (target, drafter state), the features, and the larger of the two transients. Per-token
byte counts follow the tensors each op saves for its backward, as enumerated in the comments
below; on the CPU (float32, no autocast) the tests hold them to the tensors a dispatch-mode
tracker counts. The kernel-dependent terms (flex/flash attention, fla's Gated DeltaNet kernels)
are those kernels' allocations as their sources state them; ``benchmarks/gpu_check.py`` prints
each planned term next to ``torch.cuda.max_memory_allocated`` on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.plan.shapes import DrafterDims, TargetDims

GiB = 2**30
FP32 = 4
ADAM_BYTES = 16              # float32 weight, gradient and two AdamW moments per parameter
LOGITS_CHUNK_BYTES = GiB     # float32 logits a chunk of labels may hold at once
GDN_CHUNK = 64               # fla's chunk length in the Gated DeltaNet kernels


def logits_chunk_for(vocab: int) -> int:
    """Labels whose float32 vocabulary logits exist at once: 1 GiB's worth (at least 256)."""
    return max(256, LOGITS_CHUNK_BYTES // (vocab * FP32))


@dataclass(frozen=True)
class Device:
    """Where and how the step runs: a GPU (bf16 target, bf16 autocast, flex attention, fla
    kernels) or the CPU (float32, dense attention masks); the parallel layout."""

    cuda: bool = True
    ranks: int = 1
    fsdp: bool = False

    @property
    def act_bytes(self) -> int:
        """Bytes of a linear layer's output: bf16 under autocast, else float32."""
        return 2 if self.cuda else FP32


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


def target_bytes(target: TargetDims) -> int:
    return target.params * target.dtype_bytes


def drafter_state_bytes(drafter: DrafterDims, device: Device) -> int:
    """Weights, gradients and AdamW moments; FSDP2 shards them and gathers two layers at a time
    (bf16 on a GPU, its mixed-precision policy; float32 on the CPU)."""
    if not device.fsdp:
        return drafter.params * ADAM_BYTES
    gathered = 2 * drafter.layer_params * device.act_bytes
    return math.ceil(drafter.params * ADAM_BYTES / device.ranks) + gathered


def features_bytes(target: TargetDims, drafter: DrafterDims, tokens: int) -> int:
    """The captured layers (``workers/capture.py``): ``K x tokens x H`` in the target's dtype."""
    return drafter.num_features * tokens * target.shape.hidden_size * target.dtype_bytes


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
    """A Gated DeltaNet layer at its peak under fla's chunked kernel (``chunk_gated_delta_rule``:
    its sources allocate these): the convolved q/k/v, q and k repeated to the value heads, z;
    the chunk's ``A`` (float32 and the input dtype), ``w``, ``u``, ``v_new`` and the output;
    the per-chunk states ``h [chunks, heads, dk, dv]``; the gates and betas in float32."""
    lin, a = target.linear, target.dtype_bytes
    assert lin is not None
    heads = lin.value_heads
    inputs = p * (lin.conv_width + 2 * heads * lin.key_dim + heads * lin.value_dim) * a
    chunk_a = p * heads * GDN_CHUNK * (FP32 + a)
    work = p * heads * (lin.key_dim + 3 * lin.value_dim) * a
    states = math.ceil(p / GDN_CHUNK) * heads * lin.key_dim * lin.value_dim * a
    return inputs + chunk_a + work + states + p * heads * 2 * FP32


def drafter_activation_bytes(drafter: DrafterDims, micro: Micro, device: Device,
                             checkpointing: bool, logits_chunk: int) -> int:
    """What the drafter's forward keeps for its backward, plus the backward's own peak: the
    logits' gradients, or a layer's (rebuilt first, with checkpointing), whichever is larger."""
    q, s, h = micro.queries, micro.tokens, drafter.hidden_size
    n = q + s                                       # keys and values: context, then blocks
    layer = _layer_saved(drafter, q, n, device)
    if checkpointing:   # each layer's input and the context, kept; the layers rebuilt one by one
        layers = drafter.num_hidden_layers * q * h * FP32 + s * h * FP32
    else:
        layers = drafter.num_hidden_layers * layer
    saved = layers + _once_saved(drafter, micro, device)
    logits_saved, logits_backward = _logits_bytes(drafter, micro.labels, logits_chunk, device)
    # A layer's backward: gradients of its widest tensors (gate, up, their product).
    layer_backward = 3 * q * drafter.intermediate_size * device.act_bytes
    if checkpointing:
        layer_backward += layer
    return saved + logits_saved + max(logits_backward, layer_backward)


def _layer_saved(drafter: DrafterDims, q: int, n: int, device: Device) -> int:
    """One decoder layer's saved tensors (bytes per position; float32 on the CPU):

    - queries x hidden: the input norm's normalized and output states, the attention residual,
      the post norm's two, the layer's output (autocast: norms in float32, and a bf16 copy of
      each norm output per projection reading it: 4+2+4+4+2+2+4 = 22; float32: 6 x 4);
    - queries x q width: q_proj's output and its norm (autocast: a float32 copy, the normed
      state, its bf16 copy), rotated q (as the kernel reads it), the attention output and its
      reshaped copy (autocast 10+2+2+2; float32 4 x 4);
    - keys x kv width: k_proj's output and its norm as q's, rotated k, v_proj's output
      (autocast 4+4+2+2+2; float32 4 x 4);
    - keys x hidden: the context-and-block input of k_proj and v_proj (autocast: two bf16
      copies; float32: the one tensor);
    - queries x MLP width: gate, its activation, up, their product (2 or 4 bytes each);
    - the kernel: the attention's log-sum-exp; on the CPU the float mask dense SDPA builds."""
    h, a = drafter.hidden_size, device.act_bytes
    per_q_h, per_q_w, per_n_kv, per_n_h = (22, 16, 14, 4) if device.cuda else (24, 16, 16, 4)
    kernel = drafter.num_attention_heads * q * FP32
    if not device.cuda:
        kernel += q * n * FP32
    return (q * h * per_q_h + q * drafter.q_width * per_q_w + n * drafter.kv_width * per_n_kv
            + n * h * per_n_h + 4 * q * drafter.intermediate_size * a + kernel)


def _once_saved(drafter: DrafterDims, micro: Micro, device: Device) -> int:
    """Saved once per step: the context projection's norm (autocast: float32 copy, normed, bf16
    copy = 10 bytes; float32: 2 x 4), the final norm, the rotary tables of queries and keys,
    the dense block mask (CPU), and autocast's bf16 copies of a DDP replica's weights."""
    h, q, s = drafter.hidden_size, micro.queries, micro.tokens
    norm = s * h * (10 if device.cuda else 8) + q * h * FP32
    rotary = 2 * (2 * q + s) * drafter.head_dim * FP32
    mask = 0 if device.cuda else q * (q + s)
    weights = drafter.params * 2 if device.cuda and not device.fsdp else 0
    return norm + rotary + mask + weights


def _logits_bytes(drafter: DrafterDims, labels: int, chunk: int,
                  device: Device) -> tuple[int, int]:
    """Logits over the vocabulary in chunks of labels: (kept for the backward, the backward's
    peak). Within one chunk the log-softmax is kept and the backward holds its gradient and
    the input's; past one chunk only each chunk's hidden states are kept, and the backward
    rebuilds one chunk's logits (autocast: a bf16 copy first), its log-softmax, and a gradient
    at a time."""
    vocab, taken = drafter.vocab_size, min(labels, chunk)
    if labels <= chunk:
        return taken * vocab * FP32, 2 * taken * vocab * FP32
    rebuilt = taken * vocab * ((2 if device.cuda else 0) + 3 * FP32)
    return labels * drafter.hidden_size * FP32, rebuilt


@dataclass(frozen=True)
class StepMemory:
    """One rank's bytes for one micro-batch, term by term."""

    target: int
    drafter_state: int
    features: int
    target_transient: int
    drafter_activations: int
    drafter_activations_plain: int          # without checkpointing
    drafter_activations_checkpointed: int   # with it
    checkpointing: bool

    @property
    def resident(self) -> int:
        return self.target + self.drafter_state

    @property
    def total(self) -> int:
        """The step's peak: resident, features, and the larger transient (they never overlap)."""
        return self.resident + self.features + max(self.target_transient,
                                                    self.drafter_activations)

    @classmethod
    def of(cls, target: TargetDims, drafter: DrafterDims, micro: Micro, device: Device,
           checkpointing: bool, logits_chunk: int | None = None) -> StepMemory:
        chunk = logits_chunk or logits_chunk_for(drafter.vocab_size)
        plain = drafter_activation_bytes(drafter, micro, device, False, chunk)
        saved = drafter_activation_bytes(drafter, micro, device, True, chunk)
        return cls(target_bytes(target), drafter_state_bytes(drafter, device),
                   features_bytes(target, drafter, micro.tokens),
                   target_transient_bytes(target, micro), saved if checkpointing else plain,
                   plain, saved, checkpointing)

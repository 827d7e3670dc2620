"""Bytes per rank of a training step, term by term, from shapes alone (no GPU is spent).

    micro = Micro.row(32768)                                  # one 32K-token row, alone
    need = StepMemory.of(target, drafter, micro, Device())   # .target, .drafter_state, ...
    need.total                                               # bytes at the step's peak

The terms, each the tensors it counts (docs/guides/training.md, "Long traces and memory"):

- ``target``: the frozen target's weights, whole on every rank.
- ``drafter_state``: the drafter's float32 weights, gradients and AdamW moments (16 bytes a
  parameter), sharded over the ranks with FSDP2, plus the gathered parameters (the root group
  and two layers).
- ``features``: the K captured layers of a micro-batch, ``K x tokens x H`` in the target's dtype.
- ``target_transient``: the target's forward of a micro-batch at its peak (no gradients): the
  residual streams, the widest layer's insides (the MLP, or a Gated DeltaNet layer and its
  chunked kernel's states) and, for several padded rows, the attention's padding mask.
- ``drafter_activations``: what the drafter's step keeps for its backward (every layer's
  tensors, or with activation checkpointing each layer's input and one layer rebuilt), the
  logits of one chunk and their gradient, and (with autocast, DDP) the weights' bf16 copies;
  or, where larger, the flex mask's build (:func:`mask_build_bytes`), which comes first.
- ``collective_buffers``: what the group's gradient reduction holds in the backward: under
  FSDP2 a layer's unsharded gradients beside one reduce-scatter input (float32, the policy's
  ``reduce_dtype``); replicas nothing (their gradients are all-reduced in place).
- ``runtime``: what no tensor holds: the CUDA context with cuBLAS's workspaces, NCCL's
  buffers (several ranks) and the caching allocator's fragmentation (a share of the step's
  transient memory, with ``expandable_segments``); nothing on the CPU.

The target's forward ends before the drafter's step begins, so a step's peak is the resident
part (target, drafter state), the features, the larger of the two transients, the collective
buffers and the runtime. Per-token
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
from common.plan.step_shape import FP32 as FP32
from common.plan.step_shape import Device as Device
from common.plan.step_shape import GiB as GiB
from common.plan.step_shape import Micro as Micro
from common.plan.target_memory import gated_delta_net_bytes as gated_delta_net_bytes
from common.plan.target_memory import target_transient_bytes as target_transient_bytes

ADAM_BYTES = 16              # float32 weight, gradient and two AdamW moments per parameter
LOGITS_CHUNK_BYTES = GiB     # float32 logits a chunk of labels may hold at once
REDUCE_BYTES = FP32          # FSDP2's reduce_dtype (workers/train/sharding.py)
# create_block_mask (not compiled) evaluates the mask rule over the whole query x key grid:
# its boolean intermediates peak at 3 bytes a cell, 4 with a window or a causal block (measured
# with embedded.memtrack on the rule of workers/train/drafter/masks.py).
MASK_BUILD_BYTES = 4
CUDA_CONTEXT = int(0.75 * GiB)   # the context, kernels' images, cuBLAS/cuDNN workspaces
NCCL_BUFFERS = GiB // 2          # NCCL's channels x peers x NCCL_BUFFSIZE, with several ranks
FRAGMENTATION = 0.05             # of the step's transient peak: the allocator's rounding/slack


def logits_chunk_for(vocab: int) -> int:
    """Labels whose float32 vocabulary logits exist at once: 1 GiB's worth (at least 256)."""
    return max(256, LOGITS_CHUNK_BYTES // (vocab * FP32))


def target_bytes(target: TargetDims) -> int:
    return target.params * target.dtype_bytes


def drafter_state_bytes(drafter: DrafterDims, device: Device) -> int:
    """Weights, gradients and AdamW moments (16 bytes a parameter); FSDP2 shards them and
    gathers parameters (:func:`gathered_bytes`). A replica has no DDP module, so no buckets:
    on 2 gloo ranks (tests/fsdp_probe.py), 11,554,152 bytes for 722,112 parameters (with DDP's
    reducer, whose gradients were never its bucket views, it held 14,442,600: 20 a parameter)."""
    if not device.fsdp:
        return drafter.params * ADAM_BYTES
    return math.ceil(drafter.params * ADAM_BYTES / device.ranks) + gathered_bytes(drafter, device)


def gathered_bytes(drafter: DrafterDims, device: Device) -> int:
    """FSDP2's gathered parameters (bf16 on a GPU, its policy; float32 on the CPU): the root
    group (fc, norms) from the forward to the backward's end, and two layers (one in its
    backward, the next prefetched); a forward holds a third for an instant (the previous
    all-gather's buffer), without the larger reduce-scatter buffers. On 2 gloo ranks
    (tests/fsdp_probe.py), a root of 131,328 parameters, layers of 196,928: 2,960,640 bytes
    at a forward's peak, where two layers alone planned 1,575,424."""
    if not device.fsdp:
        return 0
    root = drafter.params - drafter.num_hidden_layers * drafter.layer_params
    return (root + 2 * drafter.layer_params) * device.act_bytes


def features_bytes(target: TargetDims, drafter: DrafterDims, tokens: int) -> int:
    """The captured layers (``workers/capture.py``): ``K x tokens x H`` in the target's dtype."""
    return drafter.num_features * tokens * target.shape.hidden_size * target.dtype_bytes


def collective_bytes(drafter: DrafterDims, device: Device) -> int:
    """The gradient reduction's buffers at the backward's peak: FSDP2 reduces one parameter
    group at a time (torch's ``_fsdp_collectives.foreach_reduce``), its unsharded gradients
    (the gathered dtype) copied into a ``reduce_dtype`` reduce-scatter input; the previous
    group's input is held while this group's gradients are computed and let go before this
    input is made (``reduce_scatter_states``: one); replicas reduce in place. On 2 gloo
    ranks (tests/fsdp_probe.py), layers of 196,928 parameters: a backward's peak of 3,315,204
    bytes; two gathered layers and these 8 bytes a parameter plan 3,150,848 (two inputs,
    as once planned, 3,938,560)."""
    if not device.fsdp or device.ranks < 2:
        return 0
    group = max(drafter.layer_params, drafter.params - drafter.num_hidden_layers
                * drafter.layer_params)
    return group * (device.act_bytes + REDUCE_BYTES)


def mask_build_bytes(micro: Micro, device: Device) -> int:
    """Building the flex attention's block mask (a GPU's) evaluates the rule over the whole
    query x key grid before it keeps the blocks; the dense SDPA mask of the CPU is counted
    with the saved tensors instead."""
    return MASK_BUILD_BYTES * micro.queries * (micro.queries + micro.tokens) if device.flex else 0


def runtime_bytes(device: Device, transient: int) -> int:
    """Memory no tensor holds: the CUDA context, NCCL's buffers and the allocator's slack."""
    if not device.cuda:
        return 0
    nccl = NCCL_BUFFERS if device.ranks > 1 else 0
    return CUDA_CONTEXT + nccl + math.ceil(FRAGMENTATION * transient)


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
    # Autocast's bf16 copies of a replica's weights (FSDP2 gathers bf16 ones) live while a
    # backward saves them: a checkpointed layer's only while rebuilt (5 such layers of 196,928
    # parameters, CPU bf16 autocast: 9.59 MB kept, 11.95 MB planned with every layer's copies).
    copies = 2 if device.cuda and not device.fsdp else 0
    rebuilt = drafter.num_hidden_layers * drafter.layer_params if checkpointing else 0
    saved = layers + _once_saved(drafter, micro, device) + (drafter.params - rebuilt) * copies
    logits_saved, logits_backward = _logits_bytes(drafter, micro.labels, logits_chunk)
    # A layer's backward: gradients of its widest tensors (gate, up, their product).
    layer_backward = 3 * q * drafter.intermediate_size * device.act_bytes
    if checkpointing:
        layer_backward += layer + drafter.layer_params * copies
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
    if not device.flex:   # dense SDPA's additive mask, one per layer, in the kernel's dtype
        kernel += q * n * a
    return (q * h * per_q_h + q * drafter.q_width * per_q_w + n * drafter.kv_width * per_n_kv
            + n * h * per_n_h + 4 * q * drafter.intermediate_size * a + kernel)


def _once_saved(drafter: DrafterDims, micro: Micro, device: Device) -> int:
    """Saved once per step: the context projection's norm (autocast: float32 copy, normed, bf16
    copy = 10 bytes; float32: 2 x 4), the final norm, the rotary tables of queries and keys,
    the dense block mask (dense SDPA's)."""
    h, q, s = drafter.hidden_size, micro.queries, micro.tokens
    norm = s * h * (10 if device.cuda else 8) + q * h * FP32
    rotary = 2 * (2 * q + s) * drafter.head_dim * FP32
    mask = 0 if device.flex else q * (q + s)
    return norm + rotary + mask


def _logits_bytes(drafter: DrafterDims, labels: int, chunk: int) -> tuple[int, int]:
    """Logits over the vocabulary in chunks of labels: (kept for the backward, the backward's
    peak). Within one chunk the log-softmax is kept and the backward holds its gradient and
    the input's; past one chunk only each chunk's hidden states are kept, and the backward
    rebuilds one chunk's log-softmax and holds it with two gradients (12 bytes a cell; under
    autocast the bf16 logits are let go once copied to float32: a 256 x 5,376 chunk's backward
    measured 17.0 MB under the CPU's bf16 autocast, 16.5 MB planned, 19.3 MB with them)."""
    vocab, taken = drafter.vocab_size, min(labels, chunk)
    if labels <= chunk:
        return taken * vocab * FP32, 2 * taken * vocab * FP32
    rebuilt = taken * vocab * 3 * FP32
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
    collective_buffers: int = 0
    mask_build: int = 0                     # within drafter_activations (the larger of them)
    cuda: bool = False
    ranks: int = 1

    @property
    def resident(self) -> int:
        return self.target + self.drafter_state

    @property
    def transient(self) -> int:
        """The features and the larger transient (the target's and the drafter's never
        overlap), with the collective buffers: what a step adds to the resident part."""
        return (self.features + max(self.target_transient, self.drafter_activations)
                + self.collective_buffers)

    @property
    def runtime(self) -> int:
        return runtime_bytes(Device(self.cuda, self.ranks), self.transient)

    @property
    def total(self) -> int:
        """The step's peak: resident, transient and the runtime's share."""
        return self.resident + self.transient + self.runtime

    @classmethod
    def of(cls, target: TargetDims, drafter: DrafterDims, micro: Micro, device: Device,
           checkpointing: bool, logits_chunk: int | None = None) -> StepMemory:
        chunk = logits_chunk or logits_chunk_for(drafter.vocab_size)
        mask = mask_build_bytes(micro, device)
        plain = max(mask, drafter_activation_bytes(drafter, micro, device, False, chunk))
        saved = max(mask, drafter_activation_bytes(drafter, micro, device, True, chunk))
        return cls(target_bytes(target), drafter_state_bytes(drafter, device),
                   features_bytes(target, drafter, micro.tokens),
                   target_transient_bytes(target, micro), saved if checkpointing else plain,
                   plain, saved, checkpointing, collective_bytes(drafter, device), mask,
                   device.cuda, device.ranks)

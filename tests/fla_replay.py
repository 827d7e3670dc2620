"""fla's chunked Gated DeltaNet kernel as its sources allocate, for the CPU's memory checks:

    with fla_allocations():      # the hybrid's Gated DeltaNet layers, in this region
        target(input_ids=ids)    # each layer allocates what fla's forward allocates

On the CPU transformers runs its torch fallback for ``chunk_gated_delta_rule`` (it converts q, k
and v to float32 and keeps every chunk's matrices at once), not fla's Triton kernels, which the
memory plan counts (:func:`common.plan.memory.gated_delta_net_bytes`). This replays the kernel's
allocations from fla 0.5's sources (``fla/ops/gated_delta_rule/chunk.py`` and what it calls),
in their order and with their lifetimes, in place of the fallback; the values are the
fallback's, computed where no dispatch mode counts them and copied into the kernel's output
tensor, so the layer's output is unchanged and every other tensor of the layer is its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

CHUNK = 64   # fla's chunk length (BT)


def chunk_gated_delta_rule(reference: Any, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """fla 0.5's ``ChunkGatedDeltaRuleFunction.forward``'s tensors, the reference's values."""
    with _disable_current_modes():
        out, state = reference(query, key, value, g=g, beta=beta, initial_state=initial_state,
                               output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    # input_guard: every input made contiguous (q, k and v are slices of the convolution's
    # output), held until the forward returns.
    guarded = [x.contiguous() for x in (query, key, value, g, beta)]
    q, k, v, g, beta = guarded
    if use_qk_l2norm_in_kernel:   # l2norm_fwd: y like x, rstd float32 per row
        q, k = (torch.empty_like(x) for x in (q, k))
        rstd = [x.new_empty(x.shape[:-1], dtype=torch.float32) for x in (q, k)]
    b, t, heads = beta.shape
    g = torch.empty_like(g, dtype=torch.float32)                       # chunk_local_cumsum
    a = torch.zeros(b, t, heads, CHUNK, dtype=k.dtype)                # fused kkt + solve_tril
    w, u = k.new_empty(b, t, heads, k.shape[-1]), torch.empty_like(v)  # recompute_w_u_fwd
    h = k.new_empty(b, math.ceil(t / CHUNK), heads, k.shape[-1], v.shape[-1])   # fwd_h
    v_new = torch.empty_like(u)
    o = torch.empty_like(v_new)                                        # chunk_fwd_o
    o.copy_(out)
    del guarded, a, w, u, h, v_new, g
    if use_qk_l2norm_in_kernel:
        del rstd
    return o, state


@contextmanager
def fla_allocations() -> Iterator[None]:
    """Within: the hybrid target's Gated DeltaNet layers allocate as fla's kernel does."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    reference = modeling.torch_chunk_gated_delta_rule

    def replay(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        return chunk_gated_delta_rule(reference, *args, **kwargs)

    modeling.torch_chunk_gated_delta_rule = replay
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule = reference

"""DFlash attention patterns: which keys each block query may see, as a dense mask or a flex mask.

Keys are laid out ``[context (S packed target positions) | block 0 | block 1 | ...]`` and queries
are the blocks' positions, ``B`` per block. Block ``n`` (anchor at packed context index
``anchors[n]``, its sequence starting at ``starts[n]``) sees::

    context keys  starts[n] <= j < anchors[n]     (strictly before the anchor, own sequence only)
    block keys    every position of block n        (bidirectional inside the block)
    other blocks  nothing

A sliding-window layer (``window`` W, as SGLang's DFLASH serves it: ``window_left = W - 1``)
limits the query at block offset ``o`` (position ``anchor + o``) to keys at most ``W - 1``
positions behind it: context keys ``j >= anchors[n] + o - (W - 1)`` and block keys at offsets
``>= o - (W - 1)``. A causal layer (SGLang's default for sliding layers, or ``is_causal: true``)
sees only block offsets ``<= o``. :func:`decode_mask` is the same rule from positions, for one
block decoding over its whole context.

"Strictly before" follows SpecForge's ``create_dflash_block_mask`` (``kv_idx <
anchor_pos``): at inference the anchor is the token the target just produced, whose hidden state
does not exist yet, so it can only enter the block as a token embedding (slot 0). Every query
row sees at least its own block, so no row is fully masked (dense SDPA would return NaN).

    mask = dense_block_mask(anchors, starts, context_len=10, block_size=4)   # [N*B, S + N*B]
    block_mask = flex_block_mask(anchors, starts, 10, 4, device)             # for flex_attention
"""

from __future__ import annotations

from typing import Any

import torch


def _allowed(q_idx: torch.Tensor, kv_idx: torch.Tensor, anchors: torch.Tensor,
             starts: torch.Tensor, context_len: int, block_size: int, window: int | None,
             causal: bool) -> torch.Tensor:
    """The rule of the module docstring on broadcastable query and key index tensors."""
    block, offset = q_idx // block_size, q_idx % block_size
    anchor = anchors[block]
    context = (kv_idx < context_len) & (kv_idx >= starts[block]) & (kv_idx < anchor)
    kv_offset = (kv_idx - context_len) % block_size
    own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
    if window is not None:
        context = context & (kv_idx >= anchor + offset - (window - 1))
        own_block = own_block & (kv_offset >= offset - (window - 1))
    if causal:
        own_block = own_block & (kv_offset <= offset)
    return context | own_block


def dense_block_mask(anchors: torch.Tensor, starts: torch.Tensor, context_len: int,
                     block_size: int, window: int | None = None,
                     causal: bool = False) -> torch.Tensor:
    """The boolean allow-mask ``[N*B, S + N*B]`` (True = may attend), for SDPA on any device."""
    n = anchors.shape[0]
    q = torch.arange(n * block_size, device=anchors.device).unsqueeze(1)
    kv = torch.arange(context_len + n * block_size, device=anchors.device).unsqueeze(0)
    return _allowed(q, kv, anchors, starts, context_len, block_size, window, causal)


def flex_block_mask(anchors: torch.Tensor, starts: torch.Tensor, context_len: int,
                    block_size: int, device: torch.device | str, window: int | None = None,
                    causal: bool = False) -> Any:
    """The same pattern as a flex-attention ``BlockMask``: kept sparse, but torch's (uncompiled)
    ``create_block_mask`` builds it by evaluating the rule over the whole query x key grid, up to
    4 bytes a cell at its peak; the memory plan counts that build
    (:func:`common.plan.memory.mask_build_bytes`), which ends before the drafter's forward."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = anchors.shape[0]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:   # flex calls it with index tensors
        return _allowed(q_idx, kv_idx, anchors, starts, context_len, block_size, window, causal)

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n * block_size,
                             KV_LEN=context_len + n * block_size, device=device)


def decode_mask(block_positions: torch.Tensor, context_positions: torch.Tensor,
                window: int | None, causal: bool) -> torch.Tensor:
    """``[b, 1, Q, C + Q]`` allow-mask of one block (positions ``[b, Q]``) over its whole
    context (``[b, C]``, all before the block): the training rule, from positions."""
    q = block_positions.unsqueeze(-1)
    ctx = context_positions.unsqueeze(-2)
    blk = block_positions.unsqueeze(-2)
    context = torch.ones_like(q - ctx, dtype=torch.bool)
    own = torch.ones_like(q - blk, dtype=torch.bool)
    if window is not None:
        context = q - ctx <= window - 1
        own = q - blk <= window - 1
    if causal:
        own = own & (blk <= q)
    return torch.cat([context, own], dim=-1).unsqueeze(1)


def flex_available(device: torch.device) -> bool:
    """True where the drafter uses flex_attention: CUDA with a torch that ships it."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def batch_masks(config: Any, batch: Any, device: torch.device, flex: bool) -> Any:
    """The attention mask of a packed batch, dense or flex: one per attention kind of the
    drafter's layers (full or sliding window, bidirectional or causal in the block); the one
    mask itself when every layer is of one kind."""
    masks = {}
    for window, causal in config.attention_kinds:
        if flex:
            masks[window, causal] = flex_block_mask(batch.anchors, batch.starts, batch.tokens,
                                                    config.block_size, device, window, causal)
        else:
            masks[window, causal] = dense_block_mask(batch.anchors, batch.starts, batch.tokens,
                                                     config.block_size, window, causal)
    return next(iter(masks.values())) if len(masks) == 1 else masks

"""DFlash attention patterns: which keys each block query may see, as a dense mask or a flex mask.

Keys are laid out ``[context (S packed target positions) | block 0 | block 1 | ...]`` and queries
are the blocks' positions, ``B`` per block. Block ``n`` (anchor at packed context index
``anchors[n]``, its sequence starting at ``starts[n]``) sees::

    context keys  starts[n] <= j < anchors[n]     (strictly before the anchor, own sequence only)
    block keys    every position of block n        (bidirectional inside the block)
    other blocks  nothing

"Strictly before" follows DESIGN and SpecForge's ``create_dflash_block_mask`` (``kv_idx <
anchor_pos``): at inference the anchor is the token the target just produced, whose hidden state
does not exist yet, so it can only enter the block as a token embedding (slot 0). Every query
row sees at least its own block, so no row is fully masked (dense SDPA would return NaN).

    mask = dense_block_mask(anchors, starts, context_len=10, block_size=4)   # [N*B, S + N*B]
    block_mask = flex_block_mask(anchors, starts, 10, 4, device)             # for flex_attention
"""

from __future__ import annotations

import torch


def dense_block_mask(anchors: torch.Tensor, starts: torch.Tensor, context_len: int,
                     block_size: int) -> torch.Tensor:
    """The boolean allow-mask ``[N*B, S + N*B]`` (True = may attend), for SDPA on any device."""
    n = anchors.shape[0]
    device = anchors.device
    q_block = torch.arange(n * block_size, device=device) // block_size
    kv = torch.arange(context_len + n * block_size, device=device)
    lo = starts[q_block].unsqueeze(1)
    hi = anchors[q_block].unsqueeze(1)
    kv = kv.unsqueeze(0)
    context = (kv < context_len) & (kv >= lo) & (kv < hi)
    own_block = (kv >= context_len) & ((kv - context_len) // block_size == q_block.unsqueeze(1))
    return context | own_block


def flex_block_mask(anchors: torch.Tensor, starts: torch.Tensor, context_len: int,
                    block_size: int, device: torch.device | str):
    """The same pattern as a flex-attention ``BlockMask`` (sparse, never materialised)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = anchors.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex calls it with index tensors
        block = q_idx // block_size
        context = (kv_idx < context_len) & (kv_idx >= starts[block]) & (kv_idx < anchors[block])
        own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return context | own_block

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n * block_size,
                             KV_LEN=context_len + n * block_size, device=device)


def flex_available(device: torch.device) -> bool:
    """True where the drafter uses flex_attention: CUDA with a torch that ships it."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True

"""The DFlash block-diffusion drafter: a few Qwen3-style layers reading target-layer features.

    mask_id = add_mask_token(tokenizer, target)               # once, before building the drafter
    drafter = DFlashDraftModel.for_target(target, mask_id)    # 5 layers, block size 16
    hidden = drafter(block_ids, block_positions, features, context_positions, attn_mask)
    logits = drafter.logits(hidden)

The drafter borrows the target's embedding and LM head: they are used, frozen, but are not
submodules, so they are neither in ``parameters()`` nor in ``state_dict()`` (nor in the export).
Target features ``[S, K*H]`` (K target layers concatenated) become ``hidden_norm(fc(x))`` and are
prepended to every layer's keys and values; the block's own states are the queries and the rest
of the keys. ``attn_mask`` is a dense boolean mask or a flex ``BlockMask`` from
:mod:`workers.train.drafter.masks` (or a dict of them by :meth:`DFlashConfig.attention_kind`,
when the layers differ), or None for one block decoding over all of its context (where a
:class:`ContextCache` keeps the context's keys and values: pass only new features).

Layers are ``full_attention`` or ``sliding_attention`` (``layer_types``, with ``sliding_window``
W), read and written as SGLang's DFLASH and SpecForge do: a sliding layer's query sees keys at
most W - 1 positions behind it, and is causal inside its block unless ``is_causal`` says
otherwise (full layers are bidirectional unless ``is_causal: true``).
Parameter names match the DFlash checkpoints SGLang loads (``layers.N.self_attn.q_proj.weight``,
``fc.weight``, ``hidden_norm.weight``, ``norm.weight``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from common.runs.options import DRAFTER_LAYERS
from workers.target_heads import input_embedding, output_head, target_device
from workers.train.drafter.config import (  # noqa: F401 - the drafter's shape, re-exported
    FULL,
    LAYER_TYPES,
    MASK_TOKEN,
    SLIDING,
    DFlashConfig,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def add_mask_token(tokenizer: Any, model: PreTrainedModel) -> int:
    """Give ``tokenizer`` a mask token (``<|MASK|>`` unless it has one) and return its id.

    Grows the model's embedding (and a tied or untied LM head) only when the id falls outside
    it; Qwen3 checkpoints have spare rows, so their weights stay untouched. SGLang needs the id
    below the served target's vocab size, so for a real target this must not resize it.
    """
    if tokenizer.mask_token_id is None:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    mask_id = int(tokenizer.mask_token_id)
    rows = input_embedding(model).num_embeddings
    if mask_id >= rows:
        log.warning("growing the target embedding from %d to %d rows for %s",
                    rows, mask_id + 1, tokenizer.mask_token)
        # A fixed seed: every process (a resumed trainer, the exporter) gets the same new row.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model.resize_token_embeddings(mask_id + 1, mean_resizing=True)
    return mask_id


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, h, L, d] by per-position ``cos``/``sin`` [b, L, d]."""
    rotated: torch.Tensor = x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)
    return rotated


_COMPILED_FLEX: Any = None


def _flex_attention(device: torch.device) -> Any:
    """flex_attention: compiled once per process on CUDA; eager (a slow reference) elsewhere."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


class ContextCache:
    """Per-layer context keys/values seen so far, for decoding: they never change once computed.

    Context states are projected target features, the same input at every layer and never
    updated through the layers, so each step only projects the newly accepted tokens' features.
    """

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.positions: torch.Tensor | None = None

    def positions_seen(self, new: torch.Tensor) -> torch.Tensor:
        """Record the new context positions ``[b, n]``; all context positions so far."""
        self.positions = new if self.positions is None else torch.cat([self.positions, new], 1)
        return self.positions

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append ``[b, h, n, d]`` keys/values to ``layer``'s and return all of them."""
        if layer in self.kv:
            old_k, old_v = self.kv[layer]
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.kv[layer] = (k, v)
        return k, v


class DFlashAttention(nn.Module):
    """Qwen3 attention (q/k norms, GQA, RoPE) whose keys/values are context then block."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        bias = config.attention_bias
        heads, kv_heads, hidden = (config.num_attention_heads, config.num_key_value_heads,
                                   config.hidden_size)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                q_rope: tuple[torch.Tensor, torch.Tensor],
                k_rope: tuple[torch.Tensor, torch.Tensor], attn_mask: Any,
                cache: tuple[ContextCache, int] | None = None) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, x], dim=1)
        kv_len = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_len, -1, self.head_dim).transpose(1, 2)
        q, k = _rope(q, *q_rope), _rope(k, *k_rope)
        if cache is not None:
            n = context.shape[1]
            k_ctx, v_ctx = cache[0].extend(cache[1], k[:, :, :n], v[:, :, :n])
            k, v = torch.cat([k_ctx, k[:, :, n:]], dim=2), torch.cat([v_ctx, v[:, :, n:]], dim=2)
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif isinstance(attn_mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        else:
            out = _flex_attention(q.device)(q, k, v, block_mask=attn_mask, enable_gqa=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        return projected


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer around :class:`DFlashAttention`."""

    def __init__(self, config: DFlashConfig, qwen3: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(qwen3)

    def forward(self, x: torch.Tensor, context: torch.Tensor, q_rope: Any, k_rope: Any,
                attn_mask: Any, cache: tuple[ContextCache, int] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, q_rope, k_rope, attn_mask, cache)
        mixed: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return mixed


@dataclass(frozen=True)
class _TargetHeads:
    """The target's embedding and LM head, held outside the module tree so they stay shared."""

    embed: nn.Embedding
    lm_head: nn.Linear


class DFlashDraftModel(nn.Module):
    """DFlash drafter: N decoder layers + context projection, with the target's embed/LM head."""

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 init_seed: int = 0) -> None:
        super().__init__()
        if embed_tokens.weight.shape[0] <= config.mask_token_id:
            raise ValueError(f"the target embedding has {embed_tokens.weight.shape[0]} rows; "
                             f"mask token id {config.mask_token_id} needs a row (add_mask_token)")
        self.config = config
        qwen3 = config.qwen3_config()
        with torch.random.fork_rng(devices=[]):
            self.layers = nn.ModuleList(DFlashDecoderLayer(config, qwen3)
                                        for _ in range(config.num_hidden_layers))
            self.fc = nn.Linear(config.context_dim, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3)
        for module in (embed_tokens, lm_head):
            module.requires_grad_(False)
        self._target = _TargetHeads(embed_tokens, lm_head)
        # Activation checkpointing of the decoder layers (the train worker's setting).
        self.checkpointing = False
        self.reset_parameters(init_seed)

    @classmethod
    def for_target(cls, target: PreTrainedModel, mask_token_id: int, *,
                   num_hidden_layers: int = DRAFTER_LAYERS,
                   block_size: int = 16, num_features: int = 5,
                   layer_ids: Sequence[int] | None = None,
                   init_seed: int = 0) -> DFlashDraftModel:
        """A fresh drafter shaped after ``target`` (an HF causal LM), on the target's device."""
        config = DFlashConfig.from_target(target.config, mask_token_id,
                                          num_hidden_layers=num_hidden_layers,
                                          block_size=block_size, num_features=num_features,
                                          layer_ids=layer_ids)
        drafter = cls(config, input_embedding(target), output_head(target),
                      init_seed=init_seed)
        return drafter.to(target_device(target))

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Qwen3-style init (normal(0, initializer_range) linears, unit norms) from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                weight = torch.empty(module.weight.shape).normal_(
                    0.0, self.config.initializer_range, generator=generator)
                module.weight.copy_(weight)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, Qwen3RMSNorm):
                module.weight.fill_(1.0)

    @property
    def target_heads(self) -> _TargetHeads:
        """The target's embedding and LM head this drafter reads through (not its own)."""
        return self._target

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings from the target's frozen table."""
        embedded: torch.Tensor = self._target.embed(token_ids)
        return embedded

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits from the target's frozen LM head (in the head's dtype)."""
        logits: torch.Tensor = self._target.lm_head(hidden.to(self._target.lm_head.weight.dtype))
        return logits

    def forward(self, block_ids: torch.Tensor, block_positions: torch.Tensor,
                features: torch.Tensor, context_positions: torch.Tensor,
                attn_mask: Any, cache: ContextCache | None = None) -> torch.Tensor:
        """Final hidden states ``[b, Q, H]`` of the block positions (``[b, ...]`` inputs).

        With ``cache``, ``features``/``context_positions`` are only the context not seen yet.
        """
        x = self.embed(block_ids).to(self.fc.weight.dtype)
        # Under autocast the projection reads the features in the target's dtype (no widened
        # copy of K x S x H); without it they take the drafter's.
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(features))
        q_rope = self.rotary_emb(x, block_positions)
        k_rope = self.rotary_emb(x, torch.cat([context_positions, block_positions], dim=1))
        if attn_mask is None:
            seen = context_positions if cache is None else cache.positions_seen(context_positions)
            attn_mask = self._decode_masks(block_positions, seen)
        recompute = self.checkpointing and torch.is_grad_enabled() and cache is None
        for index, layer in enumerate(self.layers):
            mask = attn_mask.get(self.config.attention_kind(index)) \
                if isinstance(attn_mask, dict) else attn_mask
            if recompute:   # keep each layer's input only; its insides are rebuilt in backward
                x = checkpoint(layer, x, context, q_rope, k_rope, mask, use_reentrant=False)
            else:
                x = layer(x, context, q_rope, k_rope, mask,
                          None if cache is None else (cache, index))
        normed: torch.Tensor = self.norm(x)
        return normed

    def _decode_masks(self, block_positions: torch.Tensor,
                      context_positions: torch.Tensor) -> dict[Any, Any] | None:
        """Decoding masks per attention kind; None when every layer sees its whole context
        and block (full, bidirectional: no mask at all)."""
        from workers.train.drafter.masks import decode_mask

        kinds = self.config.attention_kinds
        if kinds == ((None, False),):
            return None
        return {kind: None if kind == (None, False)
                else decode_mask(block_positions, context_positions, *kind) for kind in kinds}

"""The ``tiny-qwen3.5`` architecture: a tiny hybrid of the Qwen3.5 family in Qwen3.6's shape.

The language model (``Qwen3_5ForCausalLM``: Gated DeltaNet and full attention 3:1, MRoPE with a
partial rotary dim, untied head) is trained by :mod:`embedded.tinybuild`; :func:`save` then
writes it the way the real checkpoint is laid out: a ``Qwen3_5ForConditionalGeneration`` with a
nested ``text_config``, a tiny (untrained) vision tower, an ``mtp.*`` head (one untrained
full-attention layer plus its fc and norms, which transformers ignores on load) and spare
vocabulary rows beyond the tokenizer (as Qwen pads its embedding). The vision token ids are the
last spare rows, so they never collide with text tokens, and the first spare row stays free for
the drafter's mask token (:func:`workers.train.drafter.model.add_mask_token` needs no resize).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

from embedded.tinyconsts import ENDOFTEXT, IM_END

LAYERS = 8
FULL_ATTENTION_INTERVAL = 4     # [linear] * 3 + [full], as Qwen3.6-27B
VOCAB_MULTIPLE = 256            # the embedding is padded past the tokenizer to this multiple
MTP_LAYERS = 1
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
               spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)


def padded_vocab(tokenizer_size: int) -> int:
    """The embedding rows: the tokenizer's size rounded up, always leaving some spare rows."""
    return (tokenizer_size // VOCAB_MULTIPLE + 1) * VOCAB_MULTIPLE


def text_config(tok: PreTrainedTokenizerFast) -> Qwen3_5TextConfig:
    """The language model's settings, sized like tiny-qwen3 (hidden 128, 8 layers)."""
    endoftext, im_end = tok.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    return Qwen3_5TextConfig(
        vocab_size=padded_vocab(len(tok)),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention" if (i + 1) % FULL_ATTENTION_INTERVAL else
                     "full_attention" for i in range(LAYERS)],
        max_position_embeddings=4096,
        # Qwen3.6's rope: a quarter of each head rotates, MRoPE sections over (t, h, w).
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True},
        tie_word_embeddings=False,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext,
        mtp_num_hidden_layers=MTP_LAYERS, mtp_use_dedicated_embeddings=False,
    )


def build_lm(tok: PreTrainedTokenizerFast) -> Qwen3_5ForCausalLM:
    """A freshly initialised text-only hybrid LM (what training updates)."""
    return Qwen3_5ForCausalLM(text_config(tok))


def _mtp_tensors(config: Qwen3_5TextConfig) -> dict[str, torch.Tensor]:
    """An untrained MTP head named as Qwen3.5 checkpoints name it (``mtp.*``)."""
    full = config.layer_types.index("full_attention")
    hidden = config.hidden_size
    head: dict[str, torch.Tensor] = {
        "mtp.fc.weight": torch.nn.init.normal_(torch.empty(hidden, 2 * hidden), std=0.02),
    }
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        head[f"mtp.{name}.weight"] = Qwen3_5RMSNorm(hidden).weight.detach()
    for i in range(MTP_LAYERS):
        layer = Qwen3_5DecoderLayer(config, full)
        head.update({f"mtp.layers.{i}.{k}": v.detach() for k, v in layer.state_dict().items()})
    return {k: v.contiguous().clone() for k, v in head.items()}


def save(lm: Qwen3_5ForCausalLM, generation: GenerationConfig, dest: Path) -> None:
    """Write ``lm`` into ``dest`` in the multimodal checkpoint layout, with an MTP head."""
    top = lm.config.vocab_size   # the last spare rows carry the vision markers
    config = Qwen3_5Config(
        text_config=lm.config.to_dict(),
        vision_config={**_VISION, "out_hidden_size": lm.config.hidden_size},
        image_token_id=top - 4, video_token_id=top - 3,
        vision_start_token_id=top - 2, vision_end_token_id=top - 1,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    full = Qwen3_5ForConditionalGeneration(config).eval()
    full.model.language_model.load_state_dict(lm.model.state_dict())
    full.lm_head.load_state_dict(lm.lm_head.state_dict())
    full.generation_config = generation
    full.save_pretrained(dest, safe_serialization=True)
    weights = dest / "model.safetensors"
    tensors = load_file(weights)
    tensors.update(_mtp_tensors(lm.config))
    save_file(tensors, weights, metadata={"format": "pt"})

"""Export a trained drafter as an HF-style directory that SGLang's DFLASH algorithm loads.

    export_drafter(trainer, "out/drafter")     # or a DFlashDraftModel; dtype=torch.bfloat16 to cast
    drafter = load_drafter("out/drafter", target)

    python -m sglang.launch_server --model-path <target> --speculative-algorithm DFLASH \\
        --speculative-draft-model-path out/drafter

The directory holds ``config.json`` (a Qwen3-style config with ``architectures:
["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id,
mask_token, target_layer_ids, block_size, num_target_layers}``, the layout of the z-lab/SpecForge
checkpoints, also for Qwen3.5/3.6 hybrid targets: the drafter stays a dense Qwen3 stack, its
vocabulary, depth, context and RoPE base are the target's ``text_config``) and
``model.safetensors`` with the drafter's own weights only: no embedding and no LM head, which
SGLang takes from the target.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from common.drafter.shape import SLIDING
from common.engine.target import TargetShape
from common.errors import DrafterMismatch
from workers.target_heads import input_embedding, output_head
from workers.train.drafter.config import DFlashConfig
from workers.train.drafter.export_files import CONFIG_FILE, WEIGHTS_FILE, check_export_dir
from workers.train.drafter.model import DFlashDraftModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def target_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype a target model directory stores (``config.json``), or None if it does not say.

    SGLang serves a drafter with ``--dtype auto`` in the dtype its config states, so an export
    in float32 for a bfloat16 target would run as float16; exports follow the target instead.
    """
    if not (Path(model_dir) / CONFIG_FILE).is_file():
        return None
    name = TargetShape.from_dir(model_dir).dtype   # a Qwen3.5/3.6 states it in text_config
    return DTYPES.get(name.removeprefix("torch.")) if name else None


def hf_config(config: DFlashConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` contents for ``config`` with weights stored in ``dtype``."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "mask_token": config.mask_token,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
            # SGLang's DFLASH loader reads it here first (top level: older checkpoints).
            "num_target_layers": config.num_target_layers,
        },
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": config.initializer_range,
        # As SGLang 0.5.23 reads them (srt/speculative/dflash_utils.py): a sliding layer's
        # window includes the query's own position; is_causal, when stated, holds for every
        # layer (unstated: full layers bidirectional, sliding ones causal).
        "layer_types": [config.layer_type(i) for i in range(config.num_hidden_layers)],
        **_causality(config),
        "use_sliding_window": config.sliding_window is not None and SLIDING in
        (config.layer_types or ()),
        "sliding_window": config.sliding_window if SLIDING in (config.layer_types or ()) else None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _causality(config: DFlashConfig) -> dict[str, Any]:
    if config.is_causal is not None:
        return {"is_causal": config.is_causal}
    # Unstated: full layers bidirectional (written out, as earlier exports did), sliding ones
    # causal, which only an absent key says to SGLang.
    return {} if SLIDING in (config.layer_types or ()) else {"is_causal": False}


def layer_shape(data: dict[str, Any]) -> dict[str, Any]:
    """``layer_types``, ``sliding_window`` and ``is_causal`` of a drafter ``config.json``."""
    types = data.get("layer_types")
    sliding = types is not None and SLIDING in types
    if sliding and data.get("use_sliding_window") is False:
        raise ValueError("layer_types has sliding_attention layers but use_sliding_window is "
                         "false")
    causal = data.get("is_causal")
    # DFlashConfig spells "every layer full" as None (and drops the window then); an export of
    # such a drafter writes is_causal false, which is the default there, kept None.
    return {"layer_types": tuple(types) if types is not None else None,
            "sliding_window": data.get("sliding_window"),
            "is_causal": None if causal is None or (not sliding and causal is False)
            else bool(causal)}


def export_drafter(trainer_or_model: Any, out_dir: str | Path,
                   dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for a trainer's or a bare drafter."""
    drafter: DFlashDraftModel = getattr(trainer_or_model, "drafter", trainer_or_model)
    if not isinstance(drafter, DFlashDraftModel):
        raise TypeError(f"expected a DrafterTrainer or DFlashDraftModel, not {type(drafter)}")
    dtype = dtype or drafter.fc.weight.dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().to("cpu", dtype).contiguous()
               for name, t in drafter.state_dict().items()}
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    text = json.dumps(hf_config(drafter.config, dtype), indent=2, sort_keys=True)
    (out / CONFIG_FILE).write_text(text + "\n")
    log.info("exported drafter (%d tensors, %s) to %s", len(weights), _DTYPE_NAMES[dtype], out)
    return out


def fit_problems(config: DFlashConfig, target: PreTrainedModel) -> list[str]:
    """Why a drafter cannot run on ``target`` (empty when it fits), one reason per line."""
    shape = TargetShape.of(target.config)
    rows = input_embedding(target).num_embeddings
    problems = []
    if config.hidden_size != shape.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != the target's {shape.hidden_size}")
    if config.num_target_layers != shape.num_layers:
        problems.append(f"trained on a {config.num_target_layers}-layer target; this one has "
                        f"{shape.num_layers} layers")
    if any(not 0 <= i < shape.num_layers for i in config.target_layer_ids):
        problems.append(f"target layer ids {list(config.target_layer_ids)} outside the "
                        f"target's 0..{shape.num_layers - 1}")
    if not 0 <= config.mask_token_id < rows:
        problems.append(f"mask token id {config.mask_token_id} outside the target's "
                        f"{rows}-row embedding")
    return problems


def load_drafter(path: str | Path, target: PreTrainedModel, dtype: torch.dtype | None = None,
                 tokenizer: Any = None) -> DFlashDraftModel:
    """Rebuild a drafter directory (ours, z-lab's or SpecForge's layout:
    :mod:`workers.train.drafter.published`) on ``target``'s device, sharing its embedding and
    LM head; one line (DrafterMismatch, DrafterShapeError) where it cannot."""
    from workers.train.drafter.origin import load_released
    from workers.train.drafter.published import published_config

    path = check_export_dir(path)
    config = published_config(path, target, tokenizer)
    problems = fit_problems(config, target)
    if problems:
        raise DrafterMismatch(f"drafter {path} does not fit the target: " + "; ".join(problems))
    embed = input_embedding(target)
    drafter = DFlashDraftModel(config, embed, output_head(target))
    load_released(drafter, path, f"drafter {path}")
    return drafter.to(embed.weight.device, dtype) if dtype else drafter.to(embed.weight.device)

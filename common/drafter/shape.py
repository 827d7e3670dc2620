"""A drafter's shape from a published DFlash ``config.json``: read and checked, torch-free.

Used where a drafter's shape is decided: ``enqueue --drafter-config/--init-drafter`` (frozen in
run.json, checked against the target before anything is queued) and the train worker
(:mod:`workers.train.drafter.shape` builds the drafter from it).

Fields are read under SpecForge's and z-lab's names (``num_hidden_layers``, ``layer_types``,
``sliding_window``, ``use_sliding_window``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``intermediate_size``, ``block_size``, ``dflash_config.target_layer_ids``,
``dflash_config.mask_token_id``, ``is_causal``, RoPE and norm settings); what the file does not
state comes from the target as for a drafter built without one. A field the trainer cannot
honour (a width other than the target's, another vocabulary, an attention mode other than GQA,
a key it does not know) raises :class:`DrafterShapeError` naming it; so does an architecture
other than ``DFlashDraftModel`` (DFlash2, DSpark, Domino ... are other models).

    overrides = read_shape("qwen3.5-27b-dflash.json")            # checked, target-free
    check_target(overrides, TargetShape.from_dir(target_dir))     # the target contradicts none
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.engine.target import TargetShape
from common.errors import ConfigError

SLIDING = "sliding_attention"   # the drafter layer type SGLang's DFLASH reads as windowed

ARCHITECTURE = "DFlashDraftModel"
OTHER_ARCHITECTURES = {"DFlash2DraftModel": "DFlash2", "DSparkDraftModel": "DSpark",
                       "DominoDraftModel": "Domino"}
# Honoured: the drafter takes these from the file.
SHAPE_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "block_size", "rms_norm_eps", "max_position_embeddings",
                "attention_bias", "is_causal")
# The drafter shares the target's embedding, head and features: stated, they must agree.
TARGET_FIELDS = {"hidden_size": "hidden_size", "vocab_size": "vocab_size",
                 "num_target_layers": "num_layers"}
# Facts about the file, not the model: read for consistency or not at all.
METADATA = {"architectures", "model_type", "auto_map", "dtype", "torch_dtype",
            "transformers_version", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
            "initializer_range", "max_window_layers", "_name_or_path"}
LAYER_FIELDS = {"layer_types", "sliding_window", "use_sliding_window"}
ROPE_FIELDS = {"rope_theta", "rope_parameters", "rope_scaling"}
DFLASH_FIELDS = {"target_layer_ids", "mask_token_id", "mask_token", "block_size",
                 "num_target_layers", "attention_mode"}
SUPPORTED_ACT = "silu"


class DrafterShapeError(ConfigError):
    """A drafter config the trainer cannot honour (one line, naming the field)."""


def read_shape(path: str | Path) -> dict[str, Any]:
    """The fields of a DFlash drafter ``config.json`` (a file, or a directory holding one)
    that shape the drafter, checked; raises :class:`DrafterShapeError`."""
    source = Path(path)
    file = source / "config.json" if source.is_dir() else source
    return checked_shape(read_config_file(file), str(file))


def read_config_file(file: Path) -> dict[str, Any]:
    """A drafter's ``config.json`` as a dict; one :class:`DrafterShapeError` line otherwise."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise DrafterShapeError(f"drafter config {file}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise DrafterShapeError(f"drafter config {file}: not a JSON object")
    return data


def checked_shape(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The fields of a parsed drafter ``config.json`` that shape the drafter, checked (``where``
    names it in errors); raises :class:`DrafterShapeError`."""

    def bad(field: str, why: str) -> DrafterShapeError:
        return DrafterShapeError(f"drafter config {where}: {field}: {why}")

    _check_architecture(data, bad)
    out: dict[str, Any] = {k: data[k] for k in SHAPE_FIELDS if data.get(k) is not None}
    dflash = data.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise bad("dflash_config", "not an object")
    for key, value in dflash.items():
        if key not in DFLASH_FIELDS and _states(value):
            raise bad(f"dflash_config.{key}", "not a DFlash setting this trainer knows")
    if dflash.get("attention_mode", "gqa") != "gqa":
        raise bad("dflash_config.attention_mode", f"{dflash['attention_mode']!r}: only GQA "
                                                  "attention layers are trained here")
    for key in ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers"):
        if dflash.get(key) is not None:
            out[f"dflash.{key}" if key != "block_size" else "block_size"] = dflash[key]
    for key in data:
        known = (SHAPE_FIELDS, TARGET_FIELDS, METADATA, LAYER_FIELDS, ROPE_FIELDS,
                 {"dflash_config", "hidden_act", "attention_dropout", "tie_word_embeddings",
                  "block_size"})
        if not any(key in group for group in known) and _states(data[key]):
            raise bad(key, "not a field this trainer can honour")
    if data.get("hidden_act", SUPPORTED_ACT) != SUPPORTED_ACT:
        raise bad("hidden_act", f"{data['hidden_act']!r}: the drafter's MLP is SiLU-gated")
    if data.get("attention_dropout") not in (None, 0, 0.0):
        raise bad("attention_dropout", "dropout is not trained here (must be 0)")
    if data.get("tie_word_embeddings"):
        raise bad("tie_word_embeddings", "the drafter has no embedding of its own to tie")
    for key, attr in TARGET_FIELDS.items():
        if data.get(key) is not None:
            out[f"target.{attr}"] = (key, data[key])
    out.update(_layers(data, bad))
    theta = _rope_theta(data, bad)
    if theta is not None:
        out["rope_theta"] = theta
    _check_types(out, bad)
    return out


def _check_architecture(data: dict[str, Any], bad: Any) -> None:
    names = data.get("architectures") or [ARCHITECTURE]
    if not isinstance(names, list) or ARCHITECTURE not in names:
        other = next((OTHER_ARCHITECTURES[n] for n in names if n in OTHER_ARCHITECTURES), None)
        what = f"a {other} drafter, another model than DFlash" if other else "not a DFlash drafter"
        raise bad("architectures", f"{names}: {what} (this trainer trains {ARCHITECTURE})")


def _layers(data: dict[str, Any], bad: Any) -> dict[str, Any]:
    types = data.get("layer_types")
    if types is None:
        return {}
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise bad("layer_types", "must be a list of attention type names")
    layers = data.get("num_hidden_layers", len(types))
    if len(types) != layers:
        raise bad("layer_types", f"{len(types)} entries for {layers} layers")
    unknown = sorted(set(types) - {"full_attention", SLIDING})
    if unknown:
        raise bad("layer_types", f"{unknown}: a DFlash layer is full_attention or "
                                 "sliding_attention")
    out: dict[str, Any] = {"layer_types": tuple(types)}
    if SLIDING in types:
        window = data.get("sliding_window")
        if data.get("use_sliding_window") is False:
            raise bad("use_sliding_window", "false, but layer_types has sliding_attention layers")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise bad("sliding_window", f"{window!r}: sliding_attention layers need a positive "
                                        "window")
        out["sliding_window"] = window
    return out


def _rope_theta(data: dict[str, Any], bad: Any) -> float | None:
    rope = data.get("rope_parameters") or {}
    scaling = data.get("rope_scaling")
    kind = rope.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get(
        "type") or "default"
    if kind != "default":
        raise bad("rope_parameters.rope_type", f"{kind!r}: the drafter uses default RoPE")
    theta = rope.get("rope_theta", data.get("rope_theta"))
    return None if theta is None else float(theta)


def _check_types(out: dict[str, Any], bad: Any) -> None:
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "block_size"):
        value = out.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise bad(key, f"{value!r}: must be a positive integer")
    heads, kv = out.get("num_attention_heads"), out.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise bad("num_key_value_heads", f"{kv} does not divide {heads} attention heads")
    if out.get("block_size", 2) < 2:
        raise bad("block_size", "must be at least 2")
    ids = out.get("dflash.target_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(i, int) for i in ids)):
        raise bad("dflash_config.target_layer_ids", f"{ids!r}: must be a list of layer ids")


def _states(value: Any) -> bool:
    """A value that says something (an unknown key holding null, false or 0 says nothing)."""
    return value not in (None, False, 0, "", [], {})


def check_target(shape: dict[str, Any], target: TargetShape, vocab: bool = True) -> None:
    """Raise :class:`DrafterShapeError` naming the first stated field the target contradicts
    (the mask token aside: it needs the tokenizer; ``vocab`` False skips the vocabulary, which
    grows by the mask token's row on a target without a spare one)."""
    for key, value in shape.items():
        if key == "target.vocab_size" and not vocab:
            continue
        if key.startswith("target."):
            field, stated = value
            actual = getattr(target, key.removeprefix("target."))
            if stated != actual:
                raise DrafterShapeError(f"drafter config: {field}: {stated} != the target's "
                                        f"{actual} (the drafter shares the target's embedding, "
                                        "head and layers)")
    stated_target = shape.get("dflash.num_target_layers")
    if stated_target is not None and stated_target != target.num_layers:
        raise DrafterShapeError(f"drafter config: dflash_config.num_target_layers: "
                                f"{stated_target} != the target's {target.num_layers}")
    ids = shape.get("dflash.target_layer_ids")
    if ids is not None and any(not 0 <= i < target.num_layers for i in ids):
        raise DrafterShapeError(f"drafter config: dflash_config.target_layer_ids: {ids} "
                                f"outside the target's 0..{target.num_layers - 1}")

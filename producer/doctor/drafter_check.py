"""Check a DFlash drafter export against its target before SGLang serves it.

    from producer.doctor.drafter_check import check_drafter
    for r in check_drafter(Path("out/drafter"), Path("/models/Qwen3-8B")):
        print(r.status, r.name, r.detail, r.fix)

``dflash-pipeline doctor --drafter DIR [--model TARGET]`` prints these rows. The target's
settings come from :class:`common.engine.target.TargetShape` (a Qwen3.5/3.6 checkpoint nests
them under ``text_config``). Only the two
``config.json`` files and the safetensors headers are read (no weights, no torch), so a
multi-GB export is checked in milliseconds. The tensor rules follow SGLang's DFlash loader
(``sglang/srt/models/dflash.py``, release pinned in pyproject's ``gpu`` extra): it maps
``q/k/v_proj`` onto ``qkv_proj`` and ``gate/up_proj`` onto ``gate_up_proj``, accepts an optional
``model.`` prefix, and silently skips every name it does not know, which would leave those
weights at their random init; a missing name is never loaded either.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from common.engine.preflight import CheckResult
from common.engine.target import FULL_ATTENTION, TargetShape
from common.errors import ConfigError

ARCHITECTURE = "DFlashDraftModel"
_EXPORT_FIX = ("re-export with `dflash-pipeline export-drafter --run RUN --out DIR` "
               "(config.json + model.safetensors)")
_TARGET_FIX = ("this drafter was trained for another target: pass the run's target with "
               "--model / DFLASH_MODEL, or export the drafter of a run on this target")
# safetensors header dtype names -> the names config.json uses
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_HEADER_LIMIT = 100 * 2**20  # a header larger than this is not a safetensors file


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _dtype_name(config: dict[str, Any]) -> str | None:
    """A drafter config's stated dtype (flat: the drafter is a Qwen3-style config)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return str(name).removeprefix("torch.") if name else None


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from a safetensors file's JSON header, without the tensors."""
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path.name} is too short to be a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > _HEADER_LIMIT:
            raise ValueError(f"{path.name} is not a safetensors file (header of {size} bytes)")
        header = json.loads(fh.read(size))
    return {name: (str(info["dtype"]), tuple(info["shape"]))
            for name, info in header.items() if name != "__metadata__"}


def expected_tensors(draft: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every name SGLang's DFlash loader fills, with its shape, for a drafter ``config.json``."""
    hidden, layers = int(draft["hidden_size"]), int(draft["num_hidden_layers"])
    heads = int(draft["num_attention_heads"])
    kv_heads = int(draft.get("num_key_value_heads") or heads)
    head_dim = int(draft.get("head_dim") or hidden // heads)
    inter = int(draft["intermediate_size"])
    dflash = draft.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids", draft.get("target_layer_ids"))
    # Without explicit ids SGLang picks one target layer per drafter layer.
    features = len(layer_ids) if layer_ids else layers
    q, kv = heads * head_dim, kv_heads * head_dim
    names: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, features * hidden), "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        names |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if draft.get("attention_bias"):
            names |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (hidden,)}
    return names


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_tensors(draft: dict[str, Any],
                  tensors: dict[str, tuple[str, tuple[int, ...]]]) -> CheckResult:
    """No unknown, missing or misshapen tensor names, as SGLang's loader would resolve them."""
    name = "drafter tensors"
    expected = expected_tensors(draft)
    resolved = {n.removeprefix("model."): n for n in tensors}
    unknown = sorted(stored for key, stored in resolved.items() if key not in expected)
    missing = sorted(key for key in expected if key not in resolved)
    misshapen = sorted(f"{resolved[key]} {list(tensors[resolved[key]][1])} != {list(shape)}"
                       for key, shape in expected.items()
                       if key in resolved and tensors[resolved[key]][1] != shape)
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} name(s) SGLang's DFlash loader ignores (those weights "
                        f"would stay random): {_listing(unknown)}")
    if missing:
        problems.append(f"{len(missing)} name(s) it needs are missing: {_listing(missing)}")
    if misshapen:
        problems.append(f"{len(misshapen)} shape(s) differ from config.json: "
                        f"{_listing(misshapen, 2)}")
    if problems:
        return CheckResult(name, ok=False, detail="; ".join(problems),
                           fix=f"{_EXPORT_FIX}; its names are layers.N.self_attn.q_proj.weight, "
                               "layers.N.mlp.gate_proj.weight, fc.weight, hidden_norm.weight, "
                               "norm.weight")
    return CheckResult(name, ok=True, detail=f"all {len(expected)} tensors resolve in SGLang's "
                                             "DFlash loader, shapes match config.json")


def check_dtype(draft: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...]]],
                target: TargetShape) -> CheckResult:
    """The export's config dtype and every tensor's dtype are the target's."""
    name = "drafter dtype"
    wanted = target.dtype.removeprefix("torch.") if target.dtype else None
    stated = _dtype_name(draft)
    stored = sorted({_ST_DTYPES.get(dtype, dtype) for dtype, _ in tensors.values()})
    if wanted is None:
        return CheckResult(name, ok=True, warn=True,
                           detail=f"the target's config.json states no dtype; drafter {stated}",
                           fix="make sure SGLang serves target and drafter in one dtype "
                               "(--dtype bfloat16)")
    if stated != wanted or stored != [wanted]:
        return CheckResult(name, ok=False,
                           detail=f"drafter config {stated}, tensors {'/'.join(stored)}, but the "
                                  f"target is {wanted}: SGLang's --dtype auto would serve the "
                                  "drafter in another dtype than it was checked in",
                           fix="re-export with `dflash-pipeline export-drafter --run RUN --out DIR "
                               f"--dtype auto` (the target's dtype, {wanted})")
    return CheckResult(name, ok=True, detail=f"{wanted}, as the target")


def _check_shape(draft: dict[str, Any], target: TargetShape) -> list[CheckResult]:
    results = []
    vocab = target.vocab_size
    dflash = draft.get("dflash_config") or {}
    mask_id = dflash.get("mask_token_id", draft.get("mask_token_id"))
    if mask_id is None:
        results.append(CheckResult(
            "drafter mask token", ok=True, warn=True,
            detail="no mask_token_id: SGLang looks up or adds "
                   f"{dflash.get('mask_token', '<|MASK|>')} in the tokenizer",
            fix=f"{_EXPORT_FIX}, which records the id it trained with"))
    elif not 0 <= int(mask_id) < vocab:
        results.append(CheckResult(
            "drafter mask token", ok=False,
            detail=f"mask_token_id {mask_id} is outside the target's vocabulary "
                   f"(vocab_size {vocab}): its embedding row does not exist when SGLang serves",
            fix="train on a target with a spare vocabulary row (Qwen3 checkpoints have them; "
                "add_mask_token then needs no resize), or pass the target the run trained on "
                "with --model"))
    else:
        results.append(CheckResult("drafter mask token", ok=True,
                                   detail=f"mask_token_id {mask_id} < vocab_size {vocab}"))
    hidden, target_hidden = int(draft["hidden_size"]), target.hidden_size
    results.append(
        CheckResult("drafter hidden size", ok=True, detail=f"{hidden}, as the target")
        if hidden == target_hidden else
        CheckResult("drafter hidden size", ok=False,
                    detail=f"drafter hidden_size {hidden} != target hidden_size {target_hidden}",
                    fix=_TARGET_FIX))
    results.append(_check_layers(draft, dflash, target))
    results.append(check_attention_layers(draft))
    return results


def check_attention_layers(draft: dict[str, Any]) -> CheckResult:
    """``layer_types``, ``sliding_window`` and ``is_causal`` as SGLang 0.5.23's DFLASH reads
    them (``srt/speculative/dflash_utils.py``): one type per layer, full or sliding; a sliding
    layer needs the window (served as ``window_left = sliding_window - 1``)."""
    name, layers = "drafter attention layers", int(draft["num_hidden_layers"])
    types = draft.get("layer_types")
    fix = ("write layer_types with one of full_attention/sliding_attention per draft layer, "
           "and sliding_window for sliding layers (export-drafter writes both)")
    if types is None:
        return CheckResult(name, ok=True, detail=f"{layers} full-attention layers (no "
                                                 "layer_types: SGLang's default)")
    if isinstance(types, str) or not isinstance(types, list) or len(types) != layers:
        return CheckResult(name, ok=False, detail=f"layer_types {types!r}: SGLang needs one "
                                                  f"entry per draft layer ({layers})", fix=fix)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        return CheckResult(name, ok=False, detail=f"layer_types {unknown}: SGLang's DFLASH "
                                                  "serves only full_attention and "
                                                  "sliding_attention", fix=fix)
    sliding = types.count("sliding_attention")
    window = draft.get("sliding_window")
    causal = draft.get("is_causal")
    if sliding and (not isinstance(window, int) or window < 1):
        return CheckResult(name, ok=False, detail=f"{sliding} sliding_attention layers and "
                                                  f"sliding_window {window!r}: SGLang refuses "
                                                  "to load it", fix=fix)
    if sliding and draft.get("use_sliding_window") is False:
        return CheckResult(name, ok=False, detail="sliding_attention layers with "
                                                  "use_sliding_window false", fix=fix)
    order = "causal" if causal else "bidirectional" if causal is False else \
        "sliding causal, full bidirectional"
    detail = (f"{layers - sliding} full, {sliding} sliding"
              + (f" (window {window}: each query sees {window} positions, its own included)"
                 if sliding else "") + f"; in-block attention {order}")
    return CheckResult(name, ok=True, detail=detail)


def _check_layers(draft: dict[str, Any], dflash: dict[str, Any],
                  target: TargetShape) -> CheckResult:
    """The recorded target layers exist in the target, and the drafter trained on its depth."""
    name, layers = "drafter target layers", target.num_layers
    ids = [int(i) for i in dflash.get("target_layer_ids", draft.get("target_layer_ids")) or []]
    outside = [i for i in ids if not 0 <= i < layers]
    trained = dflash.get("num_target_layers", draft.get("num_target_layers"))
    if not ids:
        return CheckResult(name, ok=True, warn=True,
                           detail="no target_layer_ids: SGLang picks its own layers, "
                                  "which need not be the ones the drafter trained on",
                           fix=f"{_EXPORT_FIX}, which records target_layer_ids")
    if outside:
        return CheckResult(name, ok=False,
                           detail=f"target_layer_ids {ids}: {outside} not below the "
                                  f"target's num_hidden_layers {layers}", fix=_TARGET_FIX)
    if trained is not None and int(trained) != layers:
        return CheckResult(name, ok=False,
                           detail=f"num_target_layers {trained}: the drafter was trained on a "
                                  f"{trained}-layer target, this one has {layers} layers",
                           fix=_TARGET_FIX)
    detail = f"target_layer_ids {ids} within {layers} layers"
    if target.is_hybrid:
        kinds = ", ".join(f"{i}:{'full' if target.layer_types[i] == FULL_ATTENTION else 'linear'}"
                          for i in ids)
        detail += f" of a hybrid target ({kinds})"
    return CheckResult(name, ok=True, detail=detail)


def check_drafter(drafter_dir: Path, target_dir: Path) -> list[CheckResult]:
    """Every drafter row: files, mask token, hidden size, target layers, dtype, tensor names."""
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    try:
        draft = _read_json(drafter_dir / "config.json")
        files = sorted(drafter_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {drafter_dir}")
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for path in files:
            tensors |= safetensors_header(path)
    except (OSError, ValueError) as exc:
        return [CheckResult("drafter files", ok=False, detail=f"{drafter_dir}: {exc}",
                            fix=_EXPORT_FIX)]
    if ARCHITECTURE not in (draft.get("architectures") or []):
        return [CheckResult("drafter files", ok=False,
                            detail=f"{drafter_dir}/config.json: architectures "
                                   f"{draft.get('architectures')} lacks {ARCHITECTURE}",
                            fix=_EXPORT_FIX)]
    try:
        target = TargetShape.from_dict(_read_json(target_dir / "config.json"),
                                       str(target_dir / "config.json"))
    except (OSError, ValueError, ConfigError) as exc:
        return [CheckResult("drafter target", ok=False, detail=f"{target_dir}: {exc}",
                            fix="pass the target model directory with --model / DFLASH_MODEL")]
    files_row = CheckResult("drafter files", ok=True,
                            detail=f"{drafter_dir}: {len(tensors)} tensors in "
                                   f"{', '.join(p.name for p in files)}; target {target_dir}")
    try:
        return [files_row, *_check_shape(draft, target), check_dtype(draft, tensors, target),
                check_tensors(draft, tensors)]
    except (KeyError, TypeError, ValueError) as exc:
        return [files_row, CheckResult("drafter config", ok=False,
                                       detail=f"config.json lacks or garbles a field: {exc!r}",
                                       fix=_EXPORT_FIX)]

"""A DFlash drafter directory in any published layout, read as our drafter's config.

    config = published_config(Path("z-lab/Qwen3-8B-DFlash-b16"), target, tokenizer)

Three layouts load the same way (``eval-drafter --drafter DIR``, ``export-drafter``'s own): ours,
z-lab's (``dflash/model.py``: ``block_size`` and ``num_target_layers`` at the top level,
``dflash_config: {mask_token_id, target_layer_ids}``; a value is read from ``dflash_config``
first, then the top level) and SpecForge's export (its ``DFlashDraftModel.save_pretrained``: the
Qwen3 config with ``dflash_config`` and ``block_size``). SGLang's DFLASH reads them alike
(``srt/speculative/dflash_utils.py``: ``parse_dflash_draft_config``): target layers unstated are
the DFlash spread over the target with one feature per draft layer; a mask token id unstated is
the id of ``dflash_config.mask_token`` (``<|MASK|>``) in the target's tokenizer. What the
drafter cannot run (another architecture, attention mode, activation, RoPE scaling, an unknown
field that holds a value) is refused in one line by :func:`common.drafter.shape.checked_shape`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.drafter.layers import dflash_layer_ids
from common.drafter.shape import SLIDING, DrafterShapeError, checked_shape, read_config_file
from common.engine.target import TargetShape
from common.errors import DrafterMismatch
from common.runs.options import DRAFTER_LAYERS
from workers.train.drafter.config import MASK_TOKEN, DFlashConfig
from workers.train.drafter.shape import shaped_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MOVABLE = ("target_layer_ids", "mask_token_id")   # z-lab also reads these at the top level
EITHER = ("block_size", "num_target_layers")      # read in either place by every reader


def normalized(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The config with z-lab's top-level DFlash values moved into ``dflash_config``; a value
    stated in both places and differing is refused (which one a server reads is its choice)."""
    out = dict(data)
    dflash = out.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise DrafterShapeError(f"drafter config {where}: dflash_config: not an object")
    dflash = dict(dflash)
    for key in (*MOVABLE, *EITHER):
        if key in out and key in dflash and out[key] != dflash[key]:
            raise DrafterShapeError(f"drafter config {where}: {key}: {out[key]!r} at the top "
                                    f"level, {dflash[key]!r} in dflash_config")
        if key in MOVABLE and key in out:
            dflash.setdefault(key, out.pop(key))
    out["dflash_config"] = dflash
    return out


def mask_id_of(dflash: dict[str, Any], tokenizer: Any, where: str) -> int:
    """The token the drafter's block is filled with: stated, or its token in the tokenizer."""
    token = dflash.get("mask_token") or MASK_TOKEN
    found = None if tokenizer is None else tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or (found == tokenizer.unk_token_id
                                      and token != tokenizer.unk_token):
        raise DrafterShapeError(f"drafter config {where}: dflash_config.mask_token_id: not "
                                f"stated, and the target's tokenizer has no {token!r}")
    return found


def published_config(path: Path, target: PreTrainedModel, tokenizer: Any = None
                     ) -> DFlashConfig:
    """The :class:`DFlashConfig` of the drafter directory ``path`` on ``target``; one line
    (:class:`DrafterShapeError`) naming the field that cannot hold."""
    where = str(path / "config.json")
    data = normalized(read_config_file(path / "config.json"), where)
    target_shape = TargetShape.of(target.config)
    unfit = []   # what the target's features and embedding fix, said as fit_problems says it
    if data.get("hidden_size") not in (None, target_shape.hidden_size):
        unfit.append(f"hidden size {data['hidden_size']} != the target's "
                     f"{target_shape.hidden_size}")
    layers_of = data["dflash_config"].get("num_target_layers", data.get("num_target_layers"))
    if layers_of not in (None, target_shape.num_layers):
        unfit.append(f"trained on a {layers_of}-layer target; this one has "
                     f"{target_shape.num_layers} layers")
    if unfit:
        raise DrafterMismatch(f"drafter {path} does not fit the target: " + "; ".join(unfit))
    shape = checked_shape(data, where)
    # The vocabulary is the target's embedding's (fit_problems checks the mask row is in it).
    shape.pop("target.vocab_size", None)
    if shape.get("is_causal") is False and SLIDING not in shape.get("layer_types", ()):
        shape.pop("is_causal")   # every layer full and bidirectional: the default spelled out
    mask = shape.get("dflash.mask_token_id")
    if mask is None:
        mask = mask_id_of(data["dflash_config"], tokenizer, where)
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise DrafterShapeError(f"drafter config {where}: dflash_config.mask_token_id: "
                                f"{mask!r}: must be a token id")
    layers = shape.get("num_hidden_layers", DRAFTER_LAYERS)
    ids = shape.get("dflash.target_layer_ids")
    try:
        ids = ids or dflash_layer_ids(target_shape.num_layers, layers)
        base = DFlashConfig.from_target(target.config, mask, num_hidden_layers=layers,
                                        layer_ids=ids)
    except ValueError as exc:
        raise DrafterShapeError(f"drafter config {where}: {exc}") from None
    return shaped_config(base, shape, target_shape)

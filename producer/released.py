"""``enqueue --init-drafter DIR``: the released drafter's weights fit its config.json.

Checked at enqueue from the safetensors headers alone (no weights read, no torch), by the rules
``doctor --drafter`` applies to an export (:mod:`producer.doctor.drafter_check`), so a drafter
that would not load is refused before anything is queued, not when its first shard trains.
"""

from __future__ import annotations

from pathlib import Path

from common.drafter.origin import DrafterOrigin
from common.engine.target import TargetShape
from common.errors import OptionRefused
from common.runs.options import DRAFTER_LAYERS
from producer.doctor.drafter_check import check_tensors, safetensors_header

# The target's own tensors a released file may carry (the drafter shares them; never loaded).
TARGET_OWNED = ("embed_tokens.", "lm_head.", "model.embed_tokens.", "model.lm_head.")


def check_released_weights(drafter: DrafterOrigin, target: TargetShape,
                           layer_ids: list[int] | None) -> None:
    """``--init-drafter``: every tensor its config.json makes is in the safetensors, of that
    shape, and nothing else but the target's embedding or head (headers only, no weights
    read); :class:`OptionRefused` (one line, exit 2) names the first problem."""
    stated = {"num_hidden_layers": DRAFTER_LAYERS, **drafter.config}
    given = {"hidden_size": target.hidden_size, "num_attention_heads": target.num_attention_heads,
             "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
             "intermediate_size": target.intermediate_size}   # what the drafter copies
    draft = {**{k: v for k, v in given.items() if v is not None}, **stated,
             "dflash_config": {"target_layer_ids": layer_ids,
                               **(stated.get("dflash_config") or {})}}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    try:
        for file in sorted(Path(drafter.path or ".").glob("*.safetensors")):
            tensors.update(safetensors_header(file))
    except (OSError, ValueError) as exc:
        raise OptionRefused(f"--init-drafter {drafter.path}: {exc}") from None
    result = check_tensors(draft, {k: v for k, v in tensors.items()
                                   if not k.startswith(TARGET_OWNED)})
    if not result.ok:
        raise OptionRefused(f"--init-drafter {drafter.path}: weights do not fit its "
                            f"config.json: {result.detail}")

"""Which target decoder layers feed the drafter: the DFlash and EAGLE-3 layouts.

Layer ``i`` here is HF's ``output_hidden_states[i + 1]`` (index 0 is the embedding output).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.choices import Layout
from common.engine.target import TargetShape
from common.errors import ConfigError


def dflash_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """K layers spread from layer 1 to layer L-4: ``round(1 + i*(L-4)/(K-1))``."""
    if num_layers < 5:
        raise ValueError(f"the DFlash layout needs at least 5 target layers, not {num_layers}")
    if k < 1:
        raise ValueError(f"need at least one target layer, not {k}")
    if k == 1:
        return [1]
    return [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high layers {1, L//2-1, L-4}; the last layer is kept separately."""
    if num_layers < 5:
        raise ValueError(f"the EAGLE-3 layout needs at least 5 target layers, not {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def layer_ids(layout: str, num_layers: int, k: int = 5) -> list[int]:
    """The target layers for ``layout`` (``dflash`` uses ``k``; ``eagle3`` is fixed)."""
    try:
        chosen = Layout(layout)
    except ValueError:
        raise ValueError(f"unknown layout {layout!r}; choose dflash or eagle3") from None
    if chosen is Layout.DFLASH:
        return dflash_layer_ids(num_layers, k)
    return eagle3_layer_ids(num_layers)


# --- ``--target-layers``: which target layers feed a DFlash drafter, frozen in run.json ---

SPREAD = "dflash"                   # the DFlash spread over all layers (an int K: the same)
FULL_ATTENTION = "full-attention"   # the full-attention layers of a hybrid (spread if many)
AFTER_FULL = "after-full"           # the layer after each full-attention layer (spread if many)
STRATEGIES = (SPREAD, FULL_ATTENTION, AFTER_FULL)
DEFAULT_K = 5
# Chosen by benchmarks/target_layers.py on the tiny hybrid (docs/guides/hybrid-targets.md,
# "Target layers for hybrid targets"); a dense target keeps the DFlash spread.
HYBRID_DEFAULT = AFTER_FULL


def spread(candidates: Sequence[int], k: int) -> list[int]:
    """``k`` of ``candidates`` evenly spaced from the first to the last (all when fewer)."""
    if k >= len(candidates):
        return list(candidates)
    if k == 1:
        return [candidates[0]]
    return [candidates[int(round(i * (len(candidates) - 1) / (k - 1)))] for i in range(k)]


def resolve_target_layers(spec: str | int | None, shape: TargetShape) -> list[int]:
    """The layer ids that ``--target-layers`` names for ``shape``; ``ConfigError`` if unusable.

    ``spec``: ``K`` (the DFlash spread of K layers, as before), ``1,4,7`` (those layers),
    ``dflash[:K]``, ``full-attention[:K]``, ``after-full[:K]`` (K at most, default 5), or None
    (the default: the DFlash spread on a dense target, ``HYBRID_DEFAULT`` on a hybrid)."""
    layers = shape.num_layers
    text = str(spec).strip().lower() if spec is not None else (
        HYBRID_DEFAULT if shape.is_hybrid else SPREAD)
    try:
        if text.isdigit():
            return dflash_layer_ids(layers, int(text))
        if "," in text or text.lstrip("-").isdigit():
            return _explicit(text, layers)
        name, _, k = text.partition(":")
        count = int(k) if k else DEFAULT_K
        if name not in STRATEGIES or count < 1:
            raise ValueError(f"unknown target layers {spec!r}")
    except ValueError as exc:
        raise ConfigError(f"--target-layers {spec}: {exc}; give K, a comma list of layer ids "
                          f"(0..{layers - 1}) or one of {', '.join(STRATEGIES)} "
                          "(optionally :K)") from None
    if name == SPREAD:
        return dflash_layer_ids(layers, count)
    full = shape.full_attention_layers
    if name == AFTER_FULL:
        full = [i + 1 for i in full if i + 1 < layers]
    if not shape.is_hybrid and name != SPREAD:
        raise ConfigError(f"--target-layers {spec}: the target has no linear-attention "
                          "layers; use K or dflash")
    if not full:
        raise ConfigError(f"--target-layers {spec}: no such layer in this target")
    return spread(full, count)


def _explicit(text: str, layers: int) -> list[int]:
    ids = [int(part) for part in text.split(",") if part.strip()]
    if not ids:
        raise ValueError("no layer id")
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise ValueError(f"layer ids {bad} outside the target's 0..{layers - 1}")
    if len(set(ids)) != len(ids):
        raise ValueError("a layer id named twice")
    return ids

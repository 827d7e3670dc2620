"""Which target decoder layers feed the drafter: the DFlash and EAGLE-3 layouts.

Layer ``i`` here is HF's ``output_hidden_states[i + 1]`` (index 0 is the embedding output).
"""

from __future__ import annotations

from enum import StrEnum


class Layout(StrEnum):
    DFLASH = "dflash"
    EAGLE3 = "eagle3"


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

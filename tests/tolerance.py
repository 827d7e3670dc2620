"""Tolerances on the scale of the numbers compared: float rounding grows with a tensor's
magnitude (and differs by CPU: summation order, vector width), so a fixed ``atol`` passes on one
machine and fails on another. Every comparison of computed tensors goes through these."""

from __future__ import annotations

import torch


def scale(tensor: torch.Tensor) -> float:
    """The tensor's magnitude: its largest absolute value (1.0 for an all-zero tensor)."""
    largest = float(tensor.detach().float().abs().max()) if tensor.numel() else 0.0
    return largest or 1.0


def worst(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, as a share of ``expected``'s scale."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual.detach().float() - expected.detach().float()).abs().max()
    return float(diff) / scale(expected)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float,
                 what: str = "") -> None:
    """Every element within ``rel`` x the scale of ``expected``."""
    off = worst(actual, expected)
    assert off <= rel, f"{what or 'tensors'} differ by {off:.3g} of their scale (> {rel:g})"


def differ(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> bool:
    """Some element differs by more than ``rel`` x the scale of ``expected``."""
    return worst(actual, expected) > rel

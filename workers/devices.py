"""The one device resolver of the stages (hidden extraction, training, eval-drafter).

``auto`` is the first CUDA device when one is visible, else the CPU; ``cpu``, ``cuda``,
``cuda:N`` and ``mps`` are taken as they are; anything else, or CUDA asked for on a host
without one, is a :class:`common.errors.ConfigError` naming where the value came from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.config import DEVICE, DEVICES
from common.errors import ConfigError

if TYPE_CHECKING:
    import torch


def resolve_device(value: str, source: str = "device") -> torch.device:
    """The torch device ``value`` names; ``source`` (a variable or option) heads the error."""
    import torch

    if not DEVICE.fullmatch(value):
        raise ConfigError(f"{source}={value!r} is not a device: {DEVICES}")
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if value.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{source}={value!r} but no CUDA device is visible on this host")
    return torch.device(value)

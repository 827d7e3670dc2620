"""The target's parts a drafter shares, typed: its token embedding, its LM head, its device.

transformers types ``get_input_embeddings()`` as a bare ``nn.Module``; every target this project
loads (a causal LM) has an ``nn.Embedding`` there and an ``nn.Linear`` head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def input_embedding(target: PreTrainedModel) -> nn.Embedding:
    """The target's token embedding."""
    return cast(nn.Embedding, target.get_input_embeddings())


def output_head(target: PreTrainedModel) -> nn.Linear:
    """The target's LM head."""
    return cast(nn.Linear, target.get_output_embeddings())


def target_device(target: PreTrainedModel) -> torch.device:
    """Where the target's weights are (its embedding's device)."""
    return input_embedding(target).weight.device


def moved(model: PreTrainedModel, device: torch.device | str) -> PreTrainedModel:
    """``model.to(device)``: transformers wraps ``to`` in a decorator whose type loses the
    model (mypy reads its first argument as the model), so the call is made untyped here."""
    untyped: Any = model
    placed: PreTrainedModel = untyped.to(device)
    return placed

"""The target's chosen layers captured in one forward, and nothing else kept: what the hidden
and train stages (and evaluation) read of a target.

    capture = LayerCapture(model, layer_ids=(1, 9, 17, 25, 33))        # a causal LM or its trunk
    features = capture.features(input_ids=ids, attention_mask=mask)    # [B, T, K*H], stops early
    out, features = capture.run(input_ids=ids, cache=cache)            # to the logits (verify)
    out, features = capture.during(lambda: cache.forward(ids))         # any call of one forward

Layer ``i`` is HF's ``hidden_states[i + 1]``: the output of decoder layer ``i``, except for the
last layer, whose entry HF gives after the final norm (so captured there). Forward hooks copy
each chosen layer's output into one preallocated ``[B, T, K*H]`` buffer in the target's dtype,
so what the capture keeps alive is ``K x T x H``, never ``(L+1) x T x H`` as
``output_hidden_states=True`` does; where nothing later is needed (training features, stored
hidden states) the forward stops after the deepest chosen layer (no later layers, no final norm,
no LM head). ``final=True`` also keeps the final normed state (the eagle3 layout's last state).
Works for every decoder whose trunk holds its layers in ``layers`` and its final norm in
``norm`` (Qwen3, Qwen3.5/3.6, Qwen2/MiMo, Llama-style families).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, cast

import torch
from torch import nn

from common.errors import HiddenStateError


class _Stop(Exception):
    """Raised by the deepest hook: nothing after it is needed."""


def decoder_trunk(model: nn.Module) -> nn.Module:
    """The module that holds the decoder layers (``layers``) and the final norm (``norm``)."""
    decoder = getattr(model, "get_decoder", None)
    for candidate in (model, getattr(model, "model", None), decoder() if decoder else None):
        if candidate is not None and isinstance(getattr(candidate, "layers", None),
                                                nn.ModuleList):
            return candidate
    raise HiddenStateError(f"{type(model).__name__}: no decoder layers found (expected a "
                           "'layers' list in the model or its trunk)")


def _tensor(output: Any) -> torch.Tensor:
    """A layer's hidden states: the output itself, or its first element (older layer APIs)."""
    return output if isinstance(output, torch.Tensor) else output[0]


class LayerCapture:
    """Hooks that keep layers ``layer_ids`` (and the final state, ``final``) of one forward."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], final: bool = False) -> None:
        self.model = model
        trunk = decoder_trunk(model)
        self.layers = cast(nn.ModuleList, trunk.layers)   # decoder_trunk checked it
        self.norm: nn.Module | None = getattr(trunk, "norm", None)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.final = final
        count = len(self.layers)
        bad = [i for i in self.layer_ids if not 0 <= i < count]
        if bad or not self.layer_ids:
            raise HiddenStateError(f"layer ids {list(self.layer_ids)} outside the target's "
                                   f"0..{count - 1}")
        # HF gives the last layer's entry after the final norm: captured from the norm.
        self.normed = count - 1 in self.layer_ids
        if (self.normed or final) and self.norm is None:
            raise HiddenStateError(f"{type(model).__name__}: no final 'norm' module to capture "
                                   "the last layer's state from")
        self._buffer: torch.Tensor | None = None
        self._last: torch.Tensor | None = None

    @property
    def deepest(self) -> nn.Module:
        """The module after which nothing is needed for features (a layer, or the norm)."""
        if self.normed or self.final:
            assert self.norm is not None
            return self.norm
        return self.layers[max(self.layer_ids)]

    def _slot_hook(self, slot: int, width_of: int) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            states = _tensor(output)
            if self._buffer is None:
                *lead, hidden = states.shape
                self._buffer = torch.empty(*lead, hidden * width_of, dtype=states.dtype,
                                           device=states.device)
            hidden = states.shape[-1]
            self._buffer[..., slot * hidden:(slot + 1) * hidden].copy_(states)
        return hook

    def _final_hook(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._last = _tensor(output)

    @staticmethod
    def _stop_hook(_module: nn.Module, _args: Any, _output: Any) -> None:
        raise _Stop

    def _hooks(self, stack: ExitStack, stop: bool) -> None:
        width = len(self.layer_ids)
        for slot, index in enumerate(self.layer_ids):
            module = self.norm if index == len(self.layers) - 1 else self.layers[index]
            assert module is not None
            stack.callback(module.register_forward_hook(self._slot_hook(slot, width)).remove)
        if self.final:
            assert self.norm is not None
            stack.callback(self.norm.register_forward_hook(self._final_hook).remove)
        if stop:   # registered last: it runs after the deepest module's copy
            stack.callback(self.deepest.register_forward_hook(self._stop_hook).remove)

    def _take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        buffer, last = self._buffer, self._last
        self._buffer = self._last = None
        if buffer is None:
            raise HiddenStateError("the forward never reached the captured layers")
        return buffer, last

    def features(self, **inputs: Any) -> torch.Tensor:
        """The chosen layers ``[B, T, K*H]`` of a forward that stops after the deepest."""
        return self.features_and_last(**inputs)[0]

    def features_and_last(self, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chosen layers and (``final``) the final normed state, stopping after them."""
        with ExitStack() as stack:
            self._hooks(stack, stop=True)
            try:
                self.model(**inputs)
            except _Stop:
                pass
        return self._take()

    def run(self, **inputs: Any) -> tuple[Any, torch.Tensor]:
        """The whole forward's output (its logits: a verify step) and the chosen layers."""
        return self.during(lambda: self.model(**inputs))

    def during(self, forward: Callable[[], Any]) -> tuple[Any, torch.Tensor]:
        """``forward()``'s result (one whole forward of the model) and its chosen layers."""
        with ExitStack() as stack:
            self._hooks(stack, stop=False)
            out = forward()
        return out, self._take()[0]

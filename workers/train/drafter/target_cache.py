"""The target's cache in the speculative loop, rolled back to the accepted prefix after a verify.

    cache = TargetCache.for_target(target)            # dense: a KV cache; hybrid: KV and state
    out = cache.forward(prompt_ids[None], ...)        # prefill, or one plain decode step
    out = cache.verify(block[None], ...)              # the block of anchor + drafts
    cache.keep(kept, length)                          # the first ``kept`` block tokens stay

A full-attention layer rolls back by cropping its KV cache. A linear-attention layer (Gated
DeltaNet, Qwen3.5/3.6) holds a conv state and a recurrent state that already took in every
token of the block, rejected drafts included, and no crop can take them out again. Three ways
to put them back to the accepted prefix (``ROLLBACKS``; the benchmark measures each):

``replay``     snapshot both states before the verify; after a partial acceptance restore them
               and re-advance each linear-attention layer alone by the accepted tokens, from the
               inputs it saw in the verify (causal: the same for the accepted prefix).
``refeed``     snapshot before the verify; restore, crop and run the whole target again over
               the accepted tokens (the textbook form; costs a second forward).
``per-token``  the verify steps each linear-attention layer token by token and keeps the state
               after each, so the accepted prefix's state is picked, not recomputed. The chunked
               kernel (``chunk_gated_delta_rule``) returns the final state only, hence the steps.

Every form skips the rollback when every draft was accepted.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import DynamicCache

from common.choices import Rollback
from common.engine.target import TargetShape

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ROLLBACKS = tuple(Rollback)
DEFAULT_ROLLBACK = Rollback.REPLAY


_CACHE_ARGUMENT: dict[type[nn.Module], str] = {}


def _cache_argument(model_type: type[nn.Module]) -> str:
    """The forward's cache keyword, by model class (renamed in transformers 5)."""
    if model_type not in _CACHE_ARGUMENT:
        params = inspect.signature(model_type.forward).parameters
        _CACHE_ARGUMENT[model_type] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_ARGUMENT[model_type]


def _cloned(states: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (conv, recurrent) states, copied."""
    return states[0].clone(), states[1].clone()


def target_forward(target: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache,
                   **kw: Any) -> Any:
    """One target forward over ``ids`` [1, n] appending to ``cache``."""
    return target(input_ids=ids, use_cache=True, **{_cache_argument(type(target)): cache}, **kw)


def new_cache(target: PreTrainedModel) -> DynamicCache:
    """An empty cache of the target's layer kinds (a hybrid needs its linear-attention layers)."""
    if TargetShape.of(target).is_hybrid:
        return DynamicCache(config=target.config)
    return DynamicCache()


class TargetCache:
    """A dense target's KV cache: a rejected suffix is cropped away."""

    def __init__(self, target: PreTrainedModel, cache: DynamicCache) -> None:
        self.target, self.cache = target, cache

    @classmethod
    def for_target(cls, target: PreTrainedModel, rollback: str = DEFAULT_ROLLBACK) -> TargetCache:
        shape = TargetShape.of(target)
        if not shape.is_hybrid:
            return cls(target, DynamicCache())
        try:
            mode = Rollback(rollback)
        except ValueError:
            raise ValueError(f"unknown rollback {rollback!r}; choose one of "
                             f"{tuple(r.value for r in Rollback)}") from None
        return HybridCache(target, DynamicCache(config=target.config),
                           shape.linear_attention_layers, mode)

    def forward(self, ids: torch.Tensor, **kw: Any) -> Any:
        return target_forward(self.target, ids, self.cache, **kw)

    def verify(self, block: torch.Tensor, **kw: Any) -> Any:
        """The verify forward over ``block`` [1, B] (anchor and drafts)."""
        return self.forward(block, **kw)

    def keep(self, kept: int, length: int) -> None:
        """Keep the verified block's first ``kept`` tokens: ``length`` cached positions in all."""
        self._crop(length)

    def _crop(self, length: int) -> None:
        """Drop cached positions from ``length`` on (a negative crop: the form every version
        takes)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)


class HybridCache(TargetCache):
    """Full-attention KV cropped; linear-attention state rolled back by ``rollback``."""

    def __init__(self, target: PreTrainedModel, cache: DynamicCache, linear: list[int],
                 rollback: Rollback) -> None:
        super().__init__(target, cache)
        self.rollback = rollback
        layers = target.get_decoder().layers
        self.mixers = {i: layers[i].linear_attn for i in linear}
        self.full = [i for i in range(len(layers)) if i not in self.mixers]
        self._snapshot: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._steps: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._block: torch.Tensor | None = None

    def _states(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer: Any = self.cache.layers[i]   # a linear-attention layer's cache: its two states
        return layer.conv_states[0], layer.recurrent_states[0]

    def _restore(self, states: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        # In place: the cache's state tensors keep their (static) addresses.
        for i, (conv, recurrent) in states.items():
            now_conv, now_recurrent = self._states(i)
            now_conv.copy_(conv)
            now_recurrent.copy_(recurrent)

    def verify(self, block: torch.Tensor, **kw: Any) -> Any:
        self._block = block
        if self.rollback is Rollback.PER_TOKEN:
            return self._stepped_verify(block, **kw)
        self._snapshot = {i: _cloned(self._states(i)) for i in self.mixers}
        if self.rollback is Rollback.REFEED:
            return self.forward(block, **kw)
        hooks = [mixer.register_forward_pre_hook(functools.partial(self._record, i),
                                                 with_kwargs=True)
                 for i, mixer in self.mixers.items()]
        try:
            return self.forward(block, **kw)
        finally:
            for hook in hooks:
                hook.remove()

    def _record(self, i: int, _module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
        self._inputs[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def _stepped_verify(self, block: torch.Tensor, **kw: Any) -> Any:
        self._steps = {i: [] for i in self.mixers}
        for i, mixer in self.mixers.items():
            mixer.forward = functools.partial(self._stepped, i, mixer.forward)
        try:
            return self.forward(block, **kw)
        finally:
            for mixer in self.mixers.values():
                del mixer.forward

    def _stepped(self, i: int, step: Any, hidden_states: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        """A linear-attention layer over the block one token at a time, as plain decoding runs
        it, keeping its states after each token."""
        kwargs["attention_mask"] = None   # one token is never padding
        outs = []
        for t in range(hidden_states.shape[1]):
            outs.append(step(hidden_states[:, t:t + 1], **kwargs))
            self._steps[i].append(_cloned(self._states(i)))
        return torch.cat(outs, dim=1)

    def keep(self, kept: int, length: int) -> None:
        block, self._block = self._block, None
        if block is None or kept >= block.shape[1]:
            self._forget()
            return
        for i in self.full:
            attention: Any = self.cache.layers[i]   # a full-attention layer's cache
            extra = attention.get_seq_length() - length
            if extra > 0:
                attention.crop(-extra)
        if self.rollback is Rollback.PER_TOKEN:
            self._restore({i: steps[kept - 1] for i, steps in self._steps.items()})
        elif self.rollback is Rollback.REFEED:
            self._restore(self._snapshot)
            for i in self.full:   # back to before the block, which is fed again
                full: Any = self.cache.layers[i]
                full.crop(-kept)
            self._set_count(length - kept)
            self.forward(block[:, :kept], logits_to_keep=1)
        else:
            self._restore(self._snapshot)
            for i, mixer in self.mixers.items():
                mixer(hidden_states=self._inputs[i][:, :kept], cache=self.cache,
                      attention_mask=None)
        self._set_count(length)
        self._forget()

    def _set_count(self, length: int) -> None:
        """Set each linear-attention layer's token count to ``length``: transformers counts the
        tokens a linear-attention layer took in (5.2x on), and the model takes its next positions
        from layer 0's count, a linear-attention layer on Qwen3.5/3.6; left at the verify's
        count, every later position would run ahead by the rejected drafts."""
        for i in self.mixers:
            count = getattr(self.cache.layers[i], "cumulative_length_linear", None)
            if isinstance(count, torch.Tensor):
                count.fill_(length)

    def _forget(self) -> None:
        self._snapshot, self._inputs, self._steps = {}, {}, {}

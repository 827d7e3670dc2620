"""Live tensor bytes of a region of code, counted op by op (a dispatch-mode tracker): test and
benchmark support for checking the training memory plan against real allocations on the CPU.

    with LiveBytes() as live:
        features = capture.features(input_ids=ids)
        kept = live.current            # bytes of what the region made and still holds
    live.peak                          # the most it held at once, after any op

Every tensor an op returns is counted once per storage (views share it) from the op that made
it until the storage is freed (a weak reference says so); tensors made before the region
(weights, inputs), and views or in-place results of them, are not counted. A kernel's scratch
memory inside one op is not seen: what is counted is what tensors hold, the figure a plan of
tensors predicts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Counts the storages made inside the region: ``current`` and ``peak`` bytes."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        dead = [key for key, (ref, *_) in self._live.items() if ref.expired()]
        for key in dead:
            self.current -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        # A view or an in-place result holds an input's storage: nothing new was allocated.
        seen = {leaf.untyped_storage()._cdata for leaf in tree_leaves((args, kwargs))
                if isinstance(leaf, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                key = storage._cdata
                if key not in self._live and key not in seen:
                    self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out

    def settle(self) -> int:
        """``current`` after dropping what was freed since the last op."""
        self._sweep()
        return self.current
